"""FP8 (model.fp8 / fp8_recipe / fp8_param via torchao float8) is guarded: one-line errors without FP8
hardware or torchao, unsupported values say so; Megatron Bridge's FP8 mixed-precision recipe names map onto
the fields; on a CUDA GPU with FP8 the float8 model trains like the bf16 one (skipped without CUDA)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from longspan.core.errors import NotSupportedError
from longspan.training.configs.optim import apply_mixed_precision, get_mixed_precision_config
from longspan.training.precision import check_fp8


def _provider(**fields):
    return SimpleNamespace(**{"fp8": None, "fp8_recipe": "tensorwise", "fp8_param": False, **fields})


def test_fp8_off_is_a_no_op():
    assert check_fp8(_provider(), torch.device("cpu")) is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_fp8_without_fp8_hardware_is_one_line():
    with pytest.raises(NotSupportedError) as err:
        check_fp8(_provider(fp8="hybrid"), torch.device("cpu"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("model.fp8='hybrid' needs a CUDA GPU with FP8 (compute capability >= 8.9")


@pytest.mark.parametrize("fields, match", [
    ({"fp8": "e4m3"}, "model.fp8='e4m3' is not supported yet"),
    ({"fp8": "hybrid", "fp8_recipe": "delayed"}, "model.fp8_recipe='delayed' is not supported yet"),
    ({"fp8": "hybrid", "fp8_recipe": "mxfp8"}, "model.fp8_recipe='mxfp8' is not supported yet"),
])
def test_unsupported_fp8_values_say_not_supported_yet(fields, match):
    with pytest.raises(NotSupportedError, match=match):
        check_fp8(_provider(**fields), torch.device("cpu"))


@pytest.mark.parametrize("name, recipe", [
    ("bf16_with_fp8_current_scaling_mixed", "tensorwise"),
    ("bf16_with_fp8_delayed_scaling_mixed", "delayed"),
    ("bf16_with_fp8_subchannel_scaling_mixed", "blockwise"),
    ("bf16_with_mxfp8_mixed", "mxfp8"),
])
def test_bridge_fp8_recipe_names_map_onto_the_fields(name, recipe):
    from longspan.models.gpt_provider import GPTModelProvider

    mp = get_mixed_precision_config(name)
    assert mp.bf16 and mp.params_dtype == torch.bfloat16 and mp.fp8 == "hybrid" and mp.fp8_recipe == recipe
    model = GPTModelProvider(num_layers=1, hidden_size=8, num_attention_heads=2)
    apply_mixed_precision(mp, model)
    assert (model.fp8, model.fp8_recipe, model.bf16) == ("hybrid", recipe, True)
    assert get_mixed_precision_config("bf16_mixed").fp8 is None


def test_pretrain_with_fp8_on_cpu_fails_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only error")
    from longspan.training.pretrain import pretrain
    from tests.training.pretrain_helpers import small_config

    cfg = small_config(tmp_path, train_iters=1)
    cfg.model.fp8 = "hybrid"
    cfg.model.fp8_recipe = "tensorwise"
    with pytest.raises(NotSupportedError, match="needs a CUDA GPU with FP8"):
        pretrain(cfg)


def _fp8_capable() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        return False
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _fp8_capable(), reason="needs a CUDA GPU with FP8 and torchao")
def test_fp8_trains_like_bf16_on_gpu(tmp_path):  # pragma: no cover - runs only where a GPU is lent
    from longspan.training.pretrain import pretrain
    from tests.training.pretrain_helpers import losses_by_iteration, small_config

    runs = {}
    for fp8 in (None, "hybrid"):
        cfg = small_config(tmp_path, f"run{fp8}", train_iters=5)
        cfg.model.hidden_size, cfg.model.ffn_hidden_size = 256, 512  # float8 matmuls want multiples of 16
        apply_mixed_precision(get_mixed_precision_config("bf16_mixed"), cfg.model, cfg.optimizer, cfg.ddp)
        cfg.model.fp8, cfg.model.fp8_recipe = fp8, "tensorwise"
        pretrain(cfg)
        runs[fp8] = losses_by_iteration(cfg)
    for it, loss in runs[None].items():
        assert abs(runs["hybrid"][it] - loss) < 0.05 * loss
