"""FP8 training (``model.fp8``, ``fp8_recipe``, ``fp8_param``) through torchao.

Applied from outside, on the meta model before the parallel plans (torchtitan's order): the ``nn.Linear``
layers of the transformer layers train in FP8 (the output layer stays in bf16, as Megatron and torchtitan
keep it). Megatron's recipe names map onto torchao as follows (:data:`FP8_RECIPES`):

=============  ===========================================================  ==========  ===================
fp8_recipe     torchao                                                      model.fp8   hardware (CUDA)
=============  ===========================================================  ==========  ===================
'tensorwise'   ``torchao.float8`` Float8Linear, recipe 'tensorwise' (current  'hybrid',   capability >= 8.9
               per-tensor scaling)                                          'e4m3'      (H100/H200, L40S)
'rowwise'      ``torchao.float8`` Float8Linear, recipe 'rowwise' (per-row     'e4m3'      >= 8.9
               power-of-two scales)
'blockwise'    ``torchao.prototype.blockwise_fp8_training`` (1x128            'e4m3'      >= 9.0 (H100/H200)
               activation / 128x128 weight blocks, DeepSeek-V3's)
'mxfp8'        ``torchao.prototype.moe_training`` MXFP8TrainingOpConfig,      'e4m3'      >= 10.0 (B200/GB200)
               recipe 'mxfp8_rceil' (32-element blocks, e8m0 scales)
=============  ===========================================================  ==========  ===================

``model.fp8`` names the formats: 'hybrid' is e4m3 forward with e5m2 gradients, 'e4m3' is e4m3 everywhere;
each recipe accepts what its torchao kernels compute. Megatron's ``'delayed'`` is a one-line error: torchao
removed delayed scaling (use 'tensorwise', current scaling). ``fp8_param=True`` (FSDP2 all-gathers the float8
weights, torchao's ``enable_fsdp_float8_all_gather``) exists for 'tensorwise' only and needs FSDP2 or the
distributed optimizer. 'blockwise' and 'mxfp8' need linears without bias whose sizes are multiples of 128
and 32 (their blocks); torchao's MXFP8 wrapper would leave a bias without gradient.

torchao is an optional extra (``pip install 'longspan[fp8]'``). Every setting is checked on any machine
(:func:`check_fp8_settings`); on a device without the recipe's hardware, or without torchao, setting
``model.fp8`` is a one-line error. :func:`convert_to_fp8` with ``emulated=True`` runs torchao's emulated
kernels (tensorwise, rowwise, mxfp8), which is how the mapping is tested on a CPU.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from longspan.core.errors import NotSupportedError
from longspan.core.logging import get_logger, print_rank_0

if TYPE_CHECKING:
    from longspan.models.gpt_provider import TransformerConfig

_log = get_logger(__name__)


@dataclass(frozen=True)
class Fp8Recipe:
    """What one ``fp8_recipe`` value runs on."""

    torchao: str
    """The torchao implementation (module and config), for messages and docs."""

    formats: tuple[str, ...]
    """The ``model.fp8`` values whose casts the torchao kernels compute."""

    min_capability: tuple[int, int]
    """The smallest CUDA compute capability with the kernels."""

    hardware: str
    """The GPUs that have them, for messages."""

    fp8_param: bool = False
    """Whether FSDP2 can all-gather the float8 weights."""

    module: str = "torchao.float8"
    """The module to import (its import fails without torchao, or without triton for the prototypes)."""


FP8_RECIPES: dict[str, Fp8Recipe] = {
    "tensorwise": Fp8Recipe("torchao.float8 (recipe 'tensorwise')", ("hybrid", "e4m3"), (8, 9),
                            "H100/H200/B200, L40S, RTX 40xx", fp8_param=True),
    "rowwise": Fp8Recipe("torchao.float8 (recipe 'rowwise')", ("e4m3",), (8, 9), "H100/H200/B200, L40S, RTX 40xx"),
    "blockwise": Fp8Recipe("torchao.prototype.blockwise_fp8_training", ("e4m3",), (9, 0), "H100/H200",
                           module="torchao.prototype.blockwise_fp8_training.linear"),
    "mxfp8": Fp8Recipe("torchao.prototype.moe_training (MXFP8, recipe 'mxfp8_rceil')", ("e4m3",), (10, 0),
                       "B200/GB200 (Blackwell)", module="torchao.prototype.moe_training.config"),
}
UNAVAILABLE_RECIPES = {
    "delayed": "torchao removed delayed scaling (0.9): use fp8_recipe='tensorwise' (current scaling, "
               "mixed_precision='bf16_with_fp8_current_scaling_mixed')",
}
FORMAT_NAMES = {"hybrid": "e4m3 forward, e5m2 gradients", "e4m3": "e4m3 everywhere"}


def check_fp8_settings(provider: TransformerConfig, data_parallel_mode: str | None = None) -> str | None:
    """The fp8 recipe name when ``provider.fp8`` is on (None when off); a one-line error for a value or a
    combination no torchao recipe implements. Needs no GPU and no torchao."""
    fp8 = provider.fp8
    if not fp8:
        return None
    recipe = provider.fp8_recipe
    if recipe in UNAVAILABLE_RECIPES:
        raise NotSupportedError(f"model.fp8_recipe={recipe!r} is not available: {UNAVAILABLE_RECIPES[recipe]}")
    if recipe not in FP8_RECIPES:
        raise NotSupportedError(f"model.fp8_recipe={recipe!r} is not supported: use one of "
                                f"{', '.join(map(repr, FP8_RECIPES))}")
    spec = FP8_RECIPES[recipe]
    if fp8 not in spec.formats:
        if fp8 not in FORMAT_NAMES:
            raise NotSupportedError(f"model.fp8={fp8!r} is not supported: use 'hybrid' or 'e4m3'")
        valid = " or ".join(f"{f!r} ({FORMAT_NAMES[f]})" for f in spec.formats)
        raise NotSupportedError(f"model.fp8={fp8!r} with fp8_recipe={recipe!r}: {spec.torchao} computes "
                                f"{valid}; set model.fp8 to that")
    if provider.fp8_param:
        if not spec.fp8_param:
            raise NotSupportedError(f"model.fp8_param=True all-gathers float8 weights with fp8_recipe='tensorwise' "
                                    f"only (torchao), not {recipe!r}: set model.fp8_param=False")
        if data_parallel_mode is not None and data_parallel_mode not in ("fsdp2", "distributed_optimizer"):
            raise NotSupportedError(
                "model.fp8_param=True all-gathers float8 weights through FSDP2: set dist.use_torch_fsdp2=True or "
                "optimizer.use_distributed_optimizer=True, or model.fp8_param=False"
            )
    return recipe


def check_fp8(provider: TransformerConfig, device: torch.device, data_parallel_mode: str | None = None) -> bool:
    """Whether fp8 is on for ``provider``; a one-line NotSupportedError when it cannot run on ``device``."""
    recipe = check_fp8_settings(provider, data_parallel_mode)
    if recipe is None:
        return False
    spec = FP8_RECIPES[recipe]
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < spec.min_capability:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        major, minor = spec.min_capability
        what = "FP8" if recipe in ("tensorwise", "rowwise") else f"{recipe} FP8"
        raise NotSupportedError(
            f"model.fp8={provider.fp8!r} with fp8_recipe={recipe!r} needs a CUDA GPU with {what} (compute capability "
            f">= {major}.{minor}: {spec.hardware}); this run's device is {where}: unset model.fp8"
        )
    try:
        importlib.import_module(spec.module)
    except ImportError as exc:
        raise NotSupportedError(
            f"model.fp8={provider.fp8!r} with fp8_recipe={recipe!r} needs {spec.module} ({exc}): pip install "
            "'longspan[fp8]' (torchao; the prototypes also need triton), or unset model.fp8"
        ) from None
    return True


def apply_float8(model: nn.Module, provider: TransformerConfig, device: torch.device, data_parallel_mode: str) -> bool:
    """Convert the transformer layers' linears to FP8 training when ``provider.fp8`` is set (after checks)."""
    if not check_fp8(provider, device, data_parallel_mode):
        return False
    fp8_param = bool(provider.fp8_param)
    convert_to_fp8(model, provider.fp8_recipe, provider.fp8, fp8_param=fp8_param)
    print_rank_0(f"longspan: fp8 training ({FP8_RECIPES[provider.fp8_recipe].torchao}, fp8={provider.fp8!r}"
                 f"{', float8 all-gather' if fp8_param else ''})", _log)
    return True


def _transformer_linear(module: nn.Module, fqn: str) -> bool:
    return fqn.startswith("decoder.layers.") and isinstance(module, nn.Linear)


def convert_to_fp8(model: nn.Module, recipe: str, fp8: str, *, fp8_param: bool = False,
                   emulated: bool = False) -> nn.Module:
    """Swap the transformer layers' linears of ``model`` for torchao's FP8 training ones of ``recipe``.

    ``emulated`` uses torchao's emulated kernels (any device; for tests and debugging, not for speed).
    The swapped linears keep the ``init_*`` attributes ``init_weights`` reads (torchao builds new modules).
    """
    init_attributes = {fqn: {k: v for k, v in vars(module).items() if k.startswith("init_")}
                       for fqn, module in model.named_modules() if _transformer_linear(module, fqn)}
    _swap_linears(model, recipe, fp8, fp8_param, emulated)
    for fqn, attributes in init_attributes.items():
        for key, value in attributes.items():
            setattr(model.get_submodule(fqn), key, value)
    return model


def _swap_linears(model: nn.Module, recipe: str, fp8: str, fp8_param: bool, emulated: bool) -> None:
    if recipe in ("tensorwise", "rowwise"):
        # optional dependency: torchao (longspan[fp8]), only when model.fp8 is on
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.config import CastConfig, e4m3_dtype  # (same reason)

        config = Float8LinearConfig.from_recipe_name(recipe)
        changes: dict[str, Any] = {"emulate": emulated, "enable_fsdp_float8_all_gather": fp8_param}
        if recipe == "tensorwise" and fp8 == "e4m3":  # torchao's tensorwise default casts gradients to e5m2
            e4m3 = CastConfig(target_dtype=e4m3_dtype)
            changes.update(cast_config_grad_output=e4m3, cast_config_grad_output_for_grad_weight=e4m3)
        config = Float8LinearConfig(**{**config.__dict__, **changes})
        convert_to_float8_training(model, config=config, module_filter_fn=_transformer_linear)
    elif recipe == "blockwise":
        _check_linears(model, recipe, multiple=128)
        if emulated:
            raise NotSupportedError("fp8_recipe='blockwise' has no emulated kernels in torchao")
        # optional dependency: torchao (longspan[fp8]), only when model.fp8 is on
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinearConfig
        from torchao.quantization import quantize_  # (same reason)

        quantize_(model, Float8BlockwiseLinearConfig(), filter_fn=_transformer_linear)
    elif recipe == "mxfp8":
        _check_linears(model, recipe, multiple=32)
        # optional dependency: torchao (longspan[fp8]), only when model.fp8 is on
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_  # (same reason)

        name = MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL if emulated else MXFP8TrainingRecipe.MXFP8_RCEIL
        quantize_(model, MXFP8TrainingOpConfig.from_recipe(name), filter_fn=_transformer_linear)
    else:
        raise NotSupportedError(f"model.fp8_recipe={recipe!r} is not supported: use one of "
                                f"{', '.join(map(repr, FP8_RECIPES))}")


def _check_linears(model: nn.Module, recipe: str, multiple: int) -> None:
    """torchao's blockwise and MXFP8 linears take no bias (MXFP8's weight wrapper would leave a bias without
    gradient) and sizes that are multiples of their block (128; MX blocks of 32)."""
    for fqn, module in model.named_modules():
        if not _transformer_linear(module, fqn):
            continue
        if module.bias is not None:
            raise NotSupportedError(f"fp8_recipe={recipe!r} needs linears without bias; {fqn} has one: set "
                                    "model.add_bias_linear=False (and add_qkv_bias=False) or use 'tensorwise'")
        if module.in_features % multiple or module.out_features % multiple:
            raise NotSupportedError(f"fp8_recipe={recipe!r} needs linear sizes that are multiples of {multiple}; "
                                    f"{fqn} is {module.in_features} -> {module.out_features}: use 'tensorwise'")
