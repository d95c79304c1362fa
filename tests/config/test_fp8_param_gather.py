"""mixed_precision.fp8_param_gather is Megatron's --fp8-param-gather: the model's float8 all-gather (fp8_param)."""

from __future__ import annotations

import pytest

from longspan.config.schema.optim import MixedPrecisionConfig, apply_mixed_precision
from longspan.core.errors import NotSupportedError
from longspan.models.gpt_provider import GPTModelProvider
from longspan.parallel.float8 import check_fp8_settings
from longspan.training.config import DistributedDataParallelConfig


def test_fp8_param_gather_turns_on_the_models_float8_all_gather() -> None:
    def model_after(**mp) -> GPTModelProvider:
        model, ddp = GPTModelProvider(num_layers=1, hidden_size=8, num_attention_heads=2), DistributedDataParallelConfig()
        apply_mixed_precision(MixedPrecisionConfig(bf16=True, **mp), model, ddp)
        assert ddp.fp8_param_gather is False  # the model carries it
        return model

    assert model_after(fp8="e4m3", fp8_param_gather=True).fp8_param is True
    assert model_after(fp8="e4m3").fp8_param is False
    assert model_after(fp8_param_gather=True).fp8_param is False  # fp8 settings travel only with fp8 on
    model = model_after(fp8="e4m3", fp8_param_gather=True)
    assert check_fp8_settings(model, "fsdp2") == "tensorwise"
    with pytest.raises(NotSupportedError, match="fp8_param=True all-gathers float8 weights through FSDP2"):
        check_fp8_settings(model, "ddp")
