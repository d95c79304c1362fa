"""Layout-independent weight initialization.

Every parameter is drawn from its own ``torch.Generator`` (on the CPU, in float32) seeded from a stable hash
of ``(seed, canonical parameter name)``, then cast to the parameter's dtype and copied into whatever part of
it this process holds. So the same seed gives the same full weights whether the model is whole, split into
pipeline stages, or its parameters are DTensors sharded by tensor parallel / FSDP2 plans, and whether it
runs on CPU or GPU. Parameters are drawn one at a time: a rank never holds more than one full parameter
beyond its own shards.

How each parameter is drawn is read from the module that owns it (Megatron's rules):
- ``nn.LayerNorm`` / ``RMSNorm`` (any module with ``normalized_shape``): weight 1, bias 0;
- a module with an ``init_rule`` attribute ``(kind, value)``: that rule for its parameters ('normal' std,
  'uniform' bound, 'ones', 'zeros'; used by adapters), or a dict of such rules by parameter name; kind
  'draw' takes ``value(shape, generator) -> float32 tensor`` for parameters with their own recipe (Mamba's
  ``A_log`` / ``dt_bias``), still drawn from the parameter's own seeded generator;
- a module with an ``init_std`` attribute (longspan sets it on every ``nn.Linear`` and ``nn.Embedding``):
  weight ~ normal(0, init_std), bias 0;
- an ``init_name_overrides`` dict on a module maps its parameter names to the canonical name whose stream
  they copy (a tied output layer on the last pipeline stage starts equal to the word embeddings).
Other models (MoE, Mamba) follow the same conventions to use ``init_weights``.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from longspan.core.logging import get_logger
from longspan.core.model_parallel_config import ModelParallelConfig

_log = get_logger(__name__)

# Module names that wrappers insert into parameter names (DDP, torch.compile, checkpoint_wrapper, FSDP1).
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_parameter_name(name: str) -> str:
    """``name`` without wrapper components: ``module.decoder.layers.0._checkpoint_wrapped_module.x`` ->
    ``decoder.layers.0.x``. ``module.`` is removed only as a leading component (DDP's), the others anywhere."""
    while name.startswith("module."):
        name = name[len("module.") :]
    parts = [p for p in name.split(".") if p not in ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")]
    return ".".join(parts)


def parameter_stream_name(module_name: str, param_name: str, overrides: dict[str, str]) -> str:
    """The canonical name a parameter is drawn and loaded under: its own, or its module's
    ``init_name_overrides`` entry, which names a parameter of the model that owns the module (the tied output
    copy of a GPT model, ``language_model.`` inside a vision-language model)."""
    override = overrides.get(param_name)
    if override is not None:
        owner = module_name.rpartition(".")[0]
        return canonical_parameter_name(f"{owner}.{override}" if owner else override)
    return canonical_parameter_name(f"{module_name}.{param_name}" if module_name else param_name)


def parameter_seed(seed: int, canonical_name: str) -> int:
    """A stable 63-bit seed for ``canonical_name`` under run seed ``seed`` (SHA-256, not Python's ``hash``)."""
    digest = hashlib.sha256(f"{int(seed)}:{canonical_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor  # slow to import; already loaded wherever a DTensor exists

    return isinstance(t, DTensor)


def _init_rule(module: nn.Module, param_name: str, full_name: str) -> tuple[str, float]:
    """``("normal", std)``, ``("uniform", bound)``, ``("ones", 0)`` or ``("zeros", 0)`` for parameter ``param_name`` of ``module``."""
    rule = getattr(module, "init_rule", None)  # an explicit (kind, value) rule, e.g. adapters (longspan.peft)
    if isinstance(rule, dict):  # rules by parameter name (Mamba mixers)
        rule = rule.get(param_name)
    if rule is not None:
        return rule
    if hasattr(module, "normalized_shape"):  # LayerNorm / RMSNorm
        return ("ones", 0.0) if param_name == "weight" else ("zeros", 0.0)
    if param_name == "bias":
        return ("zeros", 0.0)
    std = getattr(module, "init_std", None)
    if std is not None:
        return ("normal", float(std))
    raise TypeError(f"init_weights: no init rule for parameter {full_name} (module {type(module).__name__})")


def _default_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if _is_dtensor(p):
            device_type = p.device_mesh.device_type
            if device_type == "cpu":
                return torch.device("cpu")
            module = getattr(torch, device_type)
            return torch.device(device_type, module.current_device())
    return torch.get_default_device()


def draw_full_parameter(seed: int, canonical_name: str, shape: torch.Size, rule: tuple[str, float]) -> torch.Tensor:
    """The full float32 CPU tensor for one parameter: the single source of truth shared by every layout."""
    kind, std = rule
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(parameter_seed(seed, canonical_name))
    if kind == "uniform":
        return torch.empty(shape).uniform_(-std, std, generator=generator)
    if kind == "draw":
        return std(shape, generator)
    return torch.empty(shape).normal_(mean=0.0, std=std, generator=generator)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, device: torch.device | str | None = None) -> nn.Module:
    """Materialize (if on the meta device) and initialize every parameter of ``model`` in place.

    Args:
        model: a plain, wrapped (DDP, compiled, checkpoint-wrapped) or parallelized model; parameters may be
            plain tensors or DTensors (after ``parallelize_module`` / ``fully_shard`` on the meta model).
        seed: the run's seed; the same seed gives the same full weights under any layout.
        device: where meta parameters materialize; default: the DTensors' mesh device, else torch's default
            device. Parameters already materialized stay where they are.

    Returns the model. Meta parameters are materialized with ``model.to_empty`` (FSDP2's documented path, which
    keeps its sharded parameters consistent), then every parameter is filled in place; an already materialized
    model keeps its parameter objects (optimizer references stay valid).
    """
    if any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers()):
        model.to_empty(device=device if device is not None else _default_device(model))
    seen: set[int] = set()
    count = 0
    for module_name, module in model.named_modules():
        overrides = getattr(module, "init_name_overrides", {})
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied parameter registered twice is drawn once
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            canonical = parameter_stream_name(module_name, param_name, overrides)
            rule = _init_rule(module, param_name, full_name)
            full = draw_full_parameter(seed, canonical, param.shape, rule).to(param.dtype)
            if _is_dtensor(param):
                from torch.distributed.tensor import distribute_tensor  # slow to import; loaded for a DTensor

                # src_data_rank=None: every rank drew the same full tensor, so each slices its own shard
                # locally with no communication (on a CUDA mesh the one full tensor visits the GPU briefly).
                local = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                ).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full)
            del full
            count += 1
    _log.debug("init_weights: initialized %d parameters with seed %d", count, seed)
    return model


def materialize_model(model: nn.Module, provider: ModelParallelConfig, seed: int | None = None,
                      device: torch.device | str | None = None) -> nn.Module:
    """Materialize a model built on the meta device from ``provider`` (what every ``build_*_model`` does last):
    draw its parameters with ``init_weights`` from ``seed`` (default ``torch.initial_seed()``), or, with
    ``perform_initialization=False``, only allocate them (contents undefined; load a checkpoint into them), as in
    Megatron. ``device`` defaults to the CPU under ``use_cpu_initialization``, else the current default device."""
    if device is None and provider.use_cpu_initialization:
        device = "cpu"
    if provider.perform_initialization:
        init_weights(model, torch.initial_seed() if seed is None else seed, device=device)
    else:
        model.to_empty(device=device if device is not None else torch.get_default_device())
    return model
