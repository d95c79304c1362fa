"""Applying a PEFT config to a model: which layers, their adapters, freezing, DoRA's magnitude, merging.

Module names are matched in Megatron's terms. A longspan linear layer has a Megatron name (what Megatron Core
calls the layer that holds its weight) and a canonical name (CanonicalLoRA's split names):

    longspan                        Megatron (LoRA, DoRA)        canonical (CanonicalLoRA)
    X.self_attention.linear_q/k/v   X.self_attention.linear_qkv  X.self_attention.linear_q/k/v
    X.self_attention.linear_proj    (same)                       (same)
    X.mlp.linear_fc1                X.mlp.linear_fc1             X.mlp.linear_fc1_up
    X.mlp.linear_fc1_gate           X.mlp.linear_fc1             X.mlp.linear_fc1_gate
    X.mlp.linear_fc2                (same)                       (same)

(and the same under ``mlp.shared_experts``). Gated attention's output gate and the gated DeltaNet mixer (a
linear-attention layer's ``self_attention``) go by Megatron's fused layers (its gate rows sit in ``linear_qkv``;
its ``GatedDeltaNet`` has one ``in_proj`` and an ``out_proj``):

    X.self_attention.linear_gate    X.self_attention.linear_qkv  X.self_attention.linear_gate
    DeltaNet X.self_attention.linear_q/k/v/z/b/a
                                    X.self_attention.in_proj     X.self_attention.in_proj_q/k/v/z/b/a
    DeltaNet X.self_attention.linear_proj
                                    X.self_attention.out_proj    X.self_attention.out_proj

A Mamba-2 mixer keeps Megatron's names, its ``in_proj`` being one linear layer per segment here (one shared A
over them, as for the DeltaNet's):

    X.mixer.in_proj.z/x/B/C/dt      X.mixer.in_proj              X.mixer.in_proj_z/x/B/C/dt
    X.mixer.out_proj                (same)                       (same)

CanonicalLoRA also takes a mixer's fused ``in_proj`` (one shared A over its projections, the DeltaNet's too), as
Bridge's CanonicalLoRA adapts a layer it does not split like LoRA.

Multi-latent attention's projections keep their own names in all
three, as in megatron-core's MLA (Bridge's DeepSeek / Moonlight recipes target them by these names):
``linear_q_proj`` (no query compression) or ``linear_q_down_proj`` + ``linear_q_up_proj``, ``linear_kv_down_proj``,
``linear_kv_up_proj``, and ``linear_proj``. A ``target_modules`` entry without ``*``/``?`` matches the last
component of that name (Bridge's rule) or the whole name; with wildcards it is an fnmatch pattern over the
whole name. Only the linear layers of transformer layers are candidates (not the output layer).
"""

from __future__ import annotations

import fnmatch
import types
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
from torch import nn
from torch.distributed.tensor import distribute_tensor

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.core.logging import get_logger, print_rank_0
from longspan.models.gated_delta_net import GatedDeltaNet
from longspan.models.init import _init_rule, canonical_parameter_name, draw_full_parameter
from longspan.models.mamba import IN_PROJ_SEGMENTS, MambaMixer
from longspan.peft.modules import DoRALinear, GroupedLoRAAdapter, LoRAAdapter, LoRALinear, adapted_grouped_mlp_forward

if TYPE_CHECKING:
    # for type checkers only: longspan.peft.config imports this module (in PEFT.apply)
    from longspan.peft.config import LowRankAdapterConfig

logger = get_logger(__name__)

ADAPTER_MARKER = ".adapter."
_ATTENTION = ("linear_q", "linear_k", "linear_v")
_MLA = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
_DELTANET_IN = ("linear_q", "linear_k", "linear_v", "linear_z", "linear_b", "linear_a")
_CANDIDATES = _ATTENTION + _MLA + _DELTANET_IN + ("linear_gate", "linear_proj", "linear_fc1", "linear_fc1_gate",
                                                  "linear_fc2")
#: the last component of every group name ``megatron_name`` / ``canonical_name`` can give, by naming
_GROUP_LEAVES = {
    "megatron": ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj") + _MLA,
    "canonical": ("linear_q", "linear_k", "linear_v", "linear_gate", "linear_proj", "linear_fc1_up", "linear_fc1_gate",
                  "linear_fc2", "in_proj") + tuple(f"in_proj_{s}" for s in ("q", "k", "v", "z", "b", "a", "x", "B", "C",
                                                                             "dt")) + ("out_proj",) + _MLA,
}


# Non-parameter state the trainer updates while the base is frozen: the aux-loss-free routing bias (moved every
# optimizer step from token counts, ``parallel.expert_parallel.update_expert_biases``).
FINETUNED_BUFFER_SUFFIXES = (".router.expert_bias",)


def is_adapter_key(name: str) -> bool:
    """True for the parameter / state-dict names of adapters (everything else is the frozen base)."""
    return ADAPTER_MARKER in f".{name}"


def is_finetuned_state_key(name: str) -> bool:
    """True for the state-dict names a PEFT finetune changes, which its checkpoint holds: the adapters and the
    buffers training updates although the base is frozen (the routing bias). Everything else comes from the
    pretrained base."""
    return is_adapter_key(name) or f".{name}".endswith(FINETUNED_BUFFER_SUFFIXES)


def megatron_name(name: str, mixer: Optional[str] = None) -> str:
    """The Megatron Core name of the layer holding longspan module ``name`` (fused qkv(+gate) / fc1; a sequence
    mixer's ``in_proj`` / ``out_proj`` when ``mixer`` names its kind, 'deltanet' or 'mamba')."""
    parent, _, leaf = name.rpartition(".")
    if mixer == "mamba":
        return parent if leaf in IN_PROJ_SEGMENTS else name  # X.mixer.in_proj.z -> X.mixer.in_proj
    if mixer == "deltanet":
        leaf = "out_proj" if leaf == "linear_proj" else "in_proj"
    elif leaf in _ATTENTION or leaf == "linear_gate":
        leaf = "linear_qkv"
    elif leaf == "linear_fc1_gate":
        leaf = "linear_fc1"
    return f"{parent}.{leaf}" if parent else leaf


def canonical_name(name: str, mixer: Optional[str] = None) -> str:
    """CanonicalLoRA's name of longspan module ``name`` (``linear_fc1`` is the up projection; a sequence mixer's
    input projections are ``in_proj_<segment>`` and its output one ``out_proj`` when ``mixer`` names its kind)."""
    parent, _, leaf = name.rpartition(".")
    if mixer == "mamba":
        return f"{parent}_{leaf}" if leaf in IN_PROJ_SEGMENTS else name  # X.mixer.in_proj.z -> X.mixer.in_proj_z
    if mixer == "deltanet":
        leaf = "out_proj" if leaf == "linear_proj" else "in_proj_" + leaf.rpartition("_")[2]
    elif leaf == "linear_fc1":
        leaf = "linear_fc1_up"
    return f"{parent}.{leaf}" if parent else leaf


def _matches(pattern: str, full_name: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(full_name, pattern)
    return pattern == full_name or pattern == full_name.rpartition(".")[2]


def _selected(peft: LowRankAdapterConfig, full_name: str) -> bool:
    if _excluded(peft, full_name):
        return False
    if not peft.target_modules:  # exclude-only mode: every candidate but the excluded
        return True
    return any(_matches(p, full_name) for p in peft.target_modules)


def _candidates(model: nn.Module) -> Iterable[tuple[str, nn.Module, Optional[str]]]:
    """(name, module, mixer kind) of every linear layer adapters may target: the kind is 'deltanet' or 'mamba'
    for a sequence mixer's projection (named by Megatron's ``in_proj`` / ``out_proj``), else None."""
    mixers = {name: "deltanet" if isinstance(module, GatedDeltaNet) else "mamba"
              for name, module in model.named_modules() if isinstance(module, (GatedDeltaNet, MambaMixer))}
    for name, module in model.named_modules():
        if ".layers." not in f".{name}":
            continue
        parent, _, leaf = name.rpartition(".")
        owner, _, projection = parent.rpartition(".")
        if mixers.get(owner) == "mamba" and projection == "in_proj" and leaf in IN_PROJ_SEGMENTS:
            yield name, module, "mamba"
        elif mixers.get(parent) == "mamba":
            if leaf == "out_proj":
                yield name, module, "mamba"
        elif leaf in _CANDIDATES:
            yield name, module, mixers.get(parent)


def _group(peft: LowRankAdapterConfig, name: str, mixer: Optional[str]) -> Optional[str]:
    """The adapter group of candidate ``name`` under ``peft``'s naming, None when not selected. CanonicalLoRA
    also takes a sequence mixer's fused Megatron name (``in_proj``: one shared A over its projections), as
    Bridge's CanonicalLoRA adapts the layers it does not split as LoRA does."""
    if peft.kind != "canonical":
        group = megatron_name(name, mixer)
        return group if _selected(peft, group) else None
    group = canonical_name(name, mixer)
    if _selected(peft, group):
        return group
    fused = megatron_name(name, mixer)
    if mixer is not None and fused != group and _selected(peft, fused) and not _excluded(peft, group):
        return fused
    return None


def _excluded(peft: LowRankAdapterConfig, full_name: str) -> bool:
    return any(_matches(p, full_name) for p in peft.exclude_modules)


def _group_leaves(peft: LowRankAdapterConfig) -> tuple[str, ...]:
    return _GROUP_LEAVES["canonical" if peft.kind == "canonical" else "megatron"]


def check_module_names(peft: LowRankAdapterConfig) -> None:
    """Refuse (one line) a ``target_modules`` / ``exclude_modules`` name without wildcards that can name no layer
    under ``peft``'s naming, in any model: a misspelling, or the other naming's name ('linear_q' for LoRA, whose
    name is 'linear_qkv'), would otherwise silently adapt (or keep) nothing. A valid name the model lacks (multi-
    latent attention's on a Llama) is fine: recipes list targets for several architectures, as Bridge's do."""
    leaves = _group_leaves(peft)
    for field_name in ("target_modules", "exclude_modules"):
        for entry in getattr(peft, field_name):
            if any(c in entry for c in "*?[") or entry.rpartition(".")[2] in leaves:
                continue
            other = "canonical" if peft.kind != "canonical" else "megatron"
            hint = (f" ('{entry}' is {'CanonicalLoRA' if other == 'canonical' else 'LoRA / DoRA'}'s naming)"
                    if entry.rpartition(".")[2] in _GROUP_LEAVES[other] else "")
            raise ConfigError(
                f"peft.{field_name} entry {entry!r} names no layer {type(peft).__name__} can adapt{hint}; valid "
                f"names: {', '.join(leaves)}, a full module path ending in one, or a pattern with * / ?")


def plan_adapters(model: nn.Module, peft: LowRankAdapterConfig) -> "OrderedDict[str, list[str]]":
    """The adapter groups for ``model``: group name (Megatron or canonical) -> longspan module names sharing
    one A (one name for an unshared adapter). Raises when a target matches nothing."""
    check_module_names(peft)
    groups: OrderedDict[str, list[str]] = OrderedDict()
    for name, module, mixer in _candidates(model):
        group = _group(peft, name, mixer)
        if group is None:
            continue
        if not isinstance(module, nn.Linear) and (peft.kind == "dora" or getattr(module, "weight", None) is None
                                                  or module.weight.dim() != 3):
            raise NotSupportedError(
                f"peft: {group} is a {type(module).__name__} (MoE experts): {type(peft).__name__} on grouped expert "
                "weights is not supported yet; exclude it, e.g. exclude_modules=['*.experts.*'], or use LoRA"
            )
        groups.setdefault(group, []).append(name)
    if not groups:
        raise ConfigError(
            f"peft.target_modules={peft.target_modules!r} (exclude_modules={peft.exclude_modules!r}) matches no "
            f"linear layer of the model; valid names: {', '.join(_group_leaves(peft))}"
        )
    return groups


def apply_adapters(model: nn.Module, peft: LowRankAdapterConfig) -> nn.Module:
    """Wrap the targeted linear layers of ``model`` with adapters and freeze every other parameter.

    Call on the meta-device model before parallel plans and ``init_weights``; adapter weights are then drawn
    from their own (seed, name) streams like every parameter. Returns ``model`` (changed in place).
    """
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ConfigError("peft: the model already has adapters")
    peft.validate()
    groups = plan_adapters(model, peft)
    wrapper = DoRALinear if peft.kind == "dora" else LoRALinear
    for group, names in groups.items():
        owner = None
        for name in names:
            base = model.get_submodule(name)
            if not isinstance(base, nn.Linear):  # routed experts: one adapter per expert, 3-D factors
                owner = _adapt_experts(model, name, base, peft, owner)
                continue
            adapter = LoRAAdapter(
                base.in_features, base.out_features, dim=peft.dim, scale=peft.scale, dropout=float(peft.dropout),
                dropout_position=peft.dropout_position, a_init=peft.lora_A_init_method,
                b_init=peft.lora_B_init_method, dtype=base.weight.dtype, device=base.weight.device, owner=owner,
                group_size=len(names), dora=peft.kind == "dora",
            )
            owner = owner or adapter
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            layer = wrapper(base, adapter)
            # read by the FSDP2 wrapping (keeps these weights out of it) and by quantize_base_weights
            layer.base_quantization = peft.base_quantization
            setattr(parent, leaf, layer)
    freeze_base(model)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print_rank_0(
        f"peft: {type(peft).__name__} on {len(groups)} module groups (rank {peft.dim}, scale {peft.scale:g}): "
        f"{trainable:,} trainable of {total:,} parameters ({100.0 * trainable / max(total, 1):.3f}%)", logger,
    )
    return model


def _adapt_experts(model: nn.Module, name: str, base: nn.Module, peft: LowRankAdapterConfig, owner: Any) -> Any:
    """Give the ``GroupedLinear`` ``name`` a per-expert adapter and make its GroupedMLP add it; returns the
    group's A owner."""
    num_experts, out_features, in_features = base.weight.shape
    adapter = GroupedLoRAAdapter(
        num_experts, in_features, out_features, dim=peft.dim, scale=peft.scale, dropout=float(peft.dropout),
        dropout_position=peft.dropout_position, a_init=peft.lora_A_init_method, b_init=peft.lora_B_init_method,
        dtype=base.weight.dtype, device=base.weight.device, owner=owner,
    )
    if owner is not None:
        owner.has_members = True
    base.adapter = adapter
    experts = model.get_submodule(name.rpartition(".")[0])
    # The experts' forward applies every expert's slab itself; this version also adds the adapters.
    experts.forward = types.MethodType(adapted_grouped_mlp_forward, experts)
    return owner or adapter


def grouped_adapted_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, GroupedLinear) of every routed-expert projection with an adapter."""
    return [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "adapter", None), GroupedLoRAAdapter)]


def freeze_base(model: nn.Module) -> None:
    """Only adapter parameters require gradients."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(name))


def adapted_layers(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(name, layer) of every adapted linear layer of ``model`` (wrapper prefixes kept)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


@torch.no_grad()
def init_dora_magnitudes(model_chunks: list[nn.Module]) -> None:
    """DoRA: set every magnitude to the current weight's row norms (after the base weights are loaded)."""
    for chunk in model_chunks:
        for _, layer in adapted_layers(chunk):
            if isinstance(layer, DoRALinear):
                layer.init_magnitude()


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter folded into its layer's weight (no adapter keys).

    ``model`` holds plain tensors (one process); LoRA adds ``s·B A``, DoRA rescales ``W + s·B A`` row-wise by
    ``m / ||W + s·B A||``.
    """
    state = {k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}
    for name, layer in adapted_layers(model):
        state[f"{name}.weight"] = layer.merged_weight().detach().clone()
    for name, layer in grouped_adapted_layers(model):
        state[f"{name}.weight"] = (layer.weight + layer.adapter.delta_weight()).detach().clone()
    return state


@torch.no_grad()
def init_adapters(model_chunks: list[nn.Module], seed: int) -> None:
    """Draw every adapter parameter from its own (seed, canonical name) stream, as ``init_weights`` draws every
    parameter: the same full adapter weights under every layout, whether or not the base was drawn (a base
    loaded from a checkpoint is materialized without drawing)."""
    for chunk in model_chunks:
        for module_name, module in chunk.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                full_name = f"{module_name}.{param_name}" if module_name else param_name
                if not is_adapter_key(full_name):
                    continue
                canonical = canonical_parameter_name(full_name)
                full = draw_full_parameter(seed, canonical, param.shape, _init_rule(module, param_name, full_name))
                full = full.to(param.dtype)
                if hasattr(param, "device_mesh"):
                    local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                    param.to_local().copy_(local)
                else:
                    param.copy_(full)


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer in place: each adapted layer becomes a plain ``nn.Linear`` holding the
    merged weight (one process, plain tensors). Returns ``model``, now without adapters (``.peft`` state gone)."""
    for name, layer in adapted_layers(model):
        if hasattr(layer.weight, "device_mesh"):
            raise NotSupportedError("merging adapters needs the whole model on one process (no DTensor parameters)")
        merged = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                           dtype=layer.weight.dtype, device=layer.weight.device)
        merged.weight.copy_(layer.merged_weight())
        if layer.bias is not None:
            merged.bias.copy_(layer.bias)
        for attr in ("init_std",):
            if hasattr(layer, attr):
                setattr(merged, attr, getattr(layer, attr))
        merged.requires_grad_(layer.weight.requires_grad)
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, merged)
    for name, layer in grouped_adapted_layers(model):
        if hasattr(layer.weight, "device_mesh"):
            raise NotSupportedError("merging adapters needs the whole model on one process (no DTensor parameters)")
        layer.weight.copy_(layer.weight + layer.adapter.delta_weight())
        del layer.adapter
        experts = model.get_submodule(name.rpartition(".")[0])
        experts.__dict__.pop("forward", None)  # back to GroupedMLP.forward
    return model
