"""FP8 (model.fp8 / fp8_recipe / fp8_param) through torchao (longspan.parallel.float8).

- every setting is checked without a GPU or torchao: values and combinations no torchao recipe implements,
  'delayed' (removed from torchao), and the hardware each recipe needs are one-line errors;
- Megatron Bridge's FP8 mixed-precision recipe names map onto fields that pass those checks (delayed: the
  one-line error);
- with torchao installed, the mapping is run on the CPU through torchao's emulated kernels: the transformer
  layers' linears (not the output layer) become torchao's FP8 ones of each recipe and the model trains close
  to, but not exactly like, the unconverted one;
- on a CUDA GPU with FP8 the float8 model trains like the bf16 one (skipped without one).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from longspan.core.errors import NotSupportedError
from longspan.config.schema.optim import apply_mixed_precision, get_mixed_precision_config
from longspan.parallel.float8 import FP8_RECIPES, check_fp8, check_fp8_settings, convert_to_fp8

CPU = torch.device("cpu")
# torchao is a test dependency (the mapping tests run its emulated kernels): missing, they fail loudly
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def _provider(**fields):
    return SimpleNamespace(**{"fp8": None, "fp8_recipe": "tensorwise", "fp8_param": False, **fields})


def test_fp8_off_is_a_no_op():
    assert check_fp8(_provider(), CPU) is False
    assert check_fp8_settings(_provider(fp8_recipe="delayed")) is None  # the recipe is only read when fp8 is on


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
@pytest.mark.parametrize("fp8, recipe, capability", [
    ("hybrid", "tensorwise", "8.9"), ("e4m3", "rowwise", "8.9"), ("e4m3", "blockwise", "9.0"),
    ("e4m3", "mxfp8", "10.0"),
])
def test_each_recipe_without_its_hardware_is_one_line(fp8, recipe, capability):
    with pytest.raises(NotSupportedError) as err:
        check_fp8(_provider(fp8=fp8, fp8_recipe=recipe), CPU)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"model.fp8={fp8!r} with fp8_recipe={recipe!r} needs a CUDA GPU with")
    assert f"(compute capability >= {capability}: " in message and "this run's device is cpu" in message


@pytest.mark.parametrize("fields, mode, match", [
    ({"fp8": "hybrid", "fp8_recipe": "delayed"}, None,
     r"model.fp8_recipe='delayed' is not available: torchao removed delayed scaling"),
    ({"fp8": "hybrid", "fp8_recipe": "custom"}, None, r"model.fp8_recipe='custom' is not supported: use one of"),
    ({"fp8": "e5m2"}, None, r"model.fp8='e5m2' is not supported: use 'hybrid' or 'e4m3'"),
    ({"fp8": "hybrid", "fp8_recipe": "mxfp8"}, None,
     r"model.fp8='hybrid' with fp8_recipe='mxfp8': .* computes 'e4m3' \(e4m3 everywhere\); set model.fp8 to that"),
    ({"fp8": "hybrid", "fp8_recipe": "rowwise"}, None, r"model.fp8='hybrid' with fp8_recipe='rowwise'"),
    ({"fp8": "e4m3", "fp8_recipe": "rowwise", "fp8_param": True}, "fsdp2",
     r"model.fp8_param=True all-gathers float8 weights with fp8_recipe='tensorwise' only"),
    ({"fp8": "hybrid", "fp8_param": True}, "ddp", r"model.fp8_param=True all-gathers float8 weights through FSDP2"),
])
def test_settings_no_recipe_implements_are_one_line_errors_on_any_device(fields, mode, match):
    with pytest.raises(NotSupportedError, match=match) as err:
        check_fp8(_provider(**fields), CPU, mode)
    assert "\n" not in str(err.value)


def test_valid_settings_pass_the_device_free_checks():
    for recipe, spec in FP8_RECIPES.items():
        for fp8 in spec.formats:
            assert check_fp8_settings(_provider(fp8=fp8, fp8_recipe=recipe), "ddp") == recipe
    assert check_fp8_settings(_provider(fp8="hybrid", fp8_param=True), "fsdp2") == "tensorwise"


@pytest.mark.parametrize("name, recipe, fp8", [
    ("bf16_with_fp8_current_scaling_mixed", "tensorwise", "hybrid"),
    ("bf16_with_fp8_delayed_scaling_mixed", "delayed", "hybrid"),
    ("bf16_with_fp8_mixed", "delayed", "hybrid"),
    ("bf16_with_fp8_subchannel_scaling_mixed", "blockwise", "e4m3"),
    ("bf16_with_mxfp8_mixed", "mxfp8", "e4m3"),
])
def test_bridge_fp8_recipe_names_map_onto_the_fields(name, recipe, fp8):
    from longspan.models.gpt_provider import GPTModelProvider

    mp = get_mixed_precision_config(name)
    assert mp.bf16 and mp.params_dtype == torch.bfloat16 and (mp.fp8, mp.fp8_recipe) == (fp8, recipe)
    model = GPTModelProvider(num_layers=1, hidden_size=8, num_attention_heads=2)
    apply_mixed_precision(mp, model)
    assert (model.fp8, model.fp8_recipe, model.bf16) == (fp8, recipe, True)
    assert get_mixed_precision_config("bf16_mixed").fp8 is None
    if recipe == "delayed":
        with pytest.raises(NotSupportedError, match="torchao removed delayed scaling"):
            check_fp8_settings(model)
    else:  # what the name sets is a combination torchao implements
        assert check_fp8_settings(model) == recipe


def _linears(**linear_kwargs) -> nn.Module:
    model = nn.Module()
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleDict({"0": nn.Sequential(nn.Linear(**linear_kwargs))})
    return model


@pytest.mark.parametrize("linear, match", [
    ({"in_features": 128, "out_features": 256, "bias": True}, "needs linears without bias; decoder.layers.0.0"),
    ({"in_features": 128, "out_features": 96, "bias": False}, "multiples of 128; decoder.layers.0.0 is 128 -> 96"),
])
def test_blockwise_shapes_are_checked_before_torchao_is_needed(linear, match):
    with pytest.raises(NotSupportedError, match=match):
        convert_to_fp8(_linears(**linear), "blockwise", "e4m3")


def test_mxfp8_needs_bias_free_linears_in_blocks_of_32():
    with pytest.raises(NotSupportedError, match="'mxfp8' needs linears without bias"):
        convert_to_fp8(_linears(in_features=64, out_features=64, bias=True), "mxfp8", "e4m3")
    with pytest.raises(NotSupportedError, match="multiples of 32; decoder.layers.0.0 is 64 -> 48"):
        convert_to_fp8(_linears(in_features=64, out_features=48, bias=False), "mxfp8", "e4m3")


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


# ------------------------------------------------------------------- the mapping, through emulated kernels
def _tiny_gpt(dtype: torch.dtype):
    from longspan.models.gpt import build_gpt_model
    from longspan.models.gpt_provider import GPTModelProvider

    provider = GPTModelProvider(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=128, vocab_size=256, seq_length=32, make_vocab_size_divisible_by=128,
                                add_bias_linear=False)
    provider.finalize()
    return build_gpt_model(provider, seed=1234).to(dtype)


def _loss_and_grad_norm(model: nn.Module) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 33), generator=gen)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
    loss.backward()
    with torch.no_grad():
        norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))
    return float(loss.detach()), float(norm)


@pytest.mark.parametrize("recipe, fp8", [("tensorwise", "hybrid"), ("tensorwise", "e4m3"), ("rowwise", "e4m3"),
                                         ("mxfp8", "e4m3")])
def test_recipes_map_onto_torchao_and_train_close_to_bf16(recipe, fp8):
    from torchao.float8.float8_linear import Float8Linear
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor

    reference = _loss_and_grad_norm(_tiny_gpt(torch.bfloat16))
    model = convert_to_fp8(_tiny_gpt(torch.bfloat16), recipe, fp8, emulated=True)
    converted = [name for name, module in model.named_modules()
                 if isinstance(module, Float8Linear) or isinstance(getattr(module, "weight", None),
                                                                    MXFP8TrainingWeightWrapperTensor)]
    want = [name for name, module in _tiny_gpt(torch.bfloat16).named_modules()
            if name.startswith("decoder.layers.") and isinstance(module, nn.Linear)]
    # Every linear of the transformer layers (attention and MLP of both), not the output layer.
    assert converted == want and len(want) >= 8 and not any("output_layer" in name for name in converted)
    if recipe != "mxfp8":
        config = model.get_submodule(want[0]).config
        assert config.cast_config_grad_output.target_dtype == (torch.float8_e5m2 if fp8 == "hybrid"
                                                               else torch.float8_e4m3fn)
    loss, norm = _loss_and_grad_norm(model)
    assert loss != reference[0]  # the matmuls really run in FP8
    assert loss == pytest.approx(reference[0], rel=0.02) and norm == pytest.approx(reference[1], rel=0.2)


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and HAS_TORCHAO


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
