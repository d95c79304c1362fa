"""FP8 training (``model.fp8``, ``fp8_recipe``, ``fp8_param``) through torchao's float8 linear layers.

Applied from outside, on the meta model before the parallel plans (torchtitan's order): every ``nn.Linear``
of the transformer layers becomes torchao's ``Float8Linear`` (the output layer stays in bf16, as Megatron
and torchtitan keep it). Which values work:

- ``fp8='hybrid'`` (e4m3 forward, e5m2 gradients: torchao's default casts); ``'e4m3'`` is not supported yet.
- ``fp8_recipe='tensorwise'`` (current scaling per tensor: Megatron Bridge's
  ``bf16_with_fp8_current_scaling_mixed``) and ``'rowwise'`` (torchao's row-wise scales). Megatron's
  ``'delayed'`` (torchao removed delayed scaling), ``'blockwise'`` and ``'mxfp8'`` are not supported yet.
- ``fp8_param=True``: FSDP2 all-gathers the float8 weights (torchao's ``enable_fsdp_float8_all_gather``);
  it needs FSDP2 or the distributed optimizer.

torchao is an optional extra (``pip install 'longspan[fp8]'``); without it, or without a CUDA GPU of compute
capability 8.9 or newer (H100, H200, B200, L40S, RTX 40xx), setting ``model.fp8`` is a one-line error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from longspan.core.errors import NotSupportedError
from longspan.core.logging import get_logger, print_rank_0

_log = get_logger(__name__)

SUPPORTED_FP8 = ("hybrid",)
SUPPORTED_RECIPES = ("tensorwise", "rowwise")


def check_fp8(provider: Any, device: torch.device) -> bool:
    """Whether fp8 is on for ``provider``; raise a one-line NotSupportedError when it cannot run here."""
    fp8 = getattr(provider, "fp8", None)
    if not fp8:
        return False
    if fp8 not in SUPPORTED_FP8:
        raise NotSupportedError(f"model.fp8={fp8!r} is not supported yet: use 'hybrid' (e4m3 forward, e5m2 gradients)")
    recipe = getattr(provider, "fp8_recipe", "tensorwise")
    if recipe not in SUPPORTED_RECIPES:
        raise NotSupportedError(
            f"model.fp8_recipe={recipe!r} is not supported yet: use one of {', '.join(SUPPORTED_RECIPES)} "
            "(mixed_precision='bf16_with_fp8_current_scaling_mixed' sets 'tensorwise')"
        )
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise NotSupportedError(
            f"model.fp8={fp8!r} needs a CUDA GPU with FP8 (compute capability >= 8.9: H100/H200/B200); this run's "
            f"device is {where}: unset model.fp8"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise NotSupportedError(
            f"model.fp8={fp8!r} needs torchao: pip install 'longspan[fp8]' (or torchao), or unset model.fp8"
        ) from None
    return True


def apply_float8(model: nn.Module, provider: Any, device: torch.device, data_parallel_mode: str) -> bool:
    """Swap the transformer layers' linears for torchao's Float8Linear when ``provider.fp8`` is set."""
    if not check_fp8(provider, device):
        return False
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    fp8_param = bool(getattr(provider, "fp8_param", False))
    if fp8_param and data_parallel_mode not in ("fsdp2", "distributed_optimizer"):
        raise NotSupportedError(
            "model.fp8_param=True all-gathers float8 weights through FSDP2: set dist.use_torch_fsdp2=True or "
            "optimizer.use_distributed_optimizer=True, or model.fp8_param=False"
        )
    config = Float8LinearConfig.from_recipe_name(provider.fp8_recipe)
    if fp8_param:
        config = Float8LinearConfig(**{**config.__dict__, "enable_fsdp_float8_all_gather": True})

    def only_transformer_layers(module: nn.Module, fqn: str) -> bool:
        return fqn.startswith("decoder.layers.") and isinstance(module, nn.Linear)

    convert_to_float8_training(model, config=config, module_filter_fn=only_transformer_layers)
    print_rank_0(f"longspan: fp8 training (torchao float8, recipe {provider.fp8_recipe}"
                 f"{', float8 all-gather' if fp8_param else ''})", _log)
    return True
