"""Adapters in Hugging Face PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

``peft.PeftModel.from_pretrained(hf_base, directory)`` loads the result onto the HF base model. Each adapted
longspan layer maps to one HF module (``AutoBridge.hf_module_name``: ``...self_attention.linear_q`` ->
``model.layers.N.self_attn.q_proj``); a Megatron-style shared A (``linear_qkv``, ``linear_fc1``) is written
as one copy of A per member (q_proj, k_proj, v_proj) with each member's slice of B, which computes exactly
the fused adapter. Where HF fuses what longspan keeps apart (a Mamba mixer's ``in_proj`` = [z | x | B | C | dt],
Phi-3's ``qkv_proj``), the layers holding its row blocks must share one A: HF's module gets that A and their
B (DoRA: magnitudes) stacked in row order, again exactly the fused adapter. DoRA layers carry
``lora_magnitude_vector`` and set ``use_dora`` (peft's DoRA is the same formula: magnitude · (W + s·B A) /
||W + s·B A|| by output row, norm detached).

An HF PEFT adapter holds adapter tensors only: the aux-loss-free routing bias a finetune also moves
(``router.expert_bias``) is not part of it (a warning says so); a merged export carries it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from longspan.core.errors import NotSupportedError
from longspan.core.logging import get_logger
from longspan.models.init import canonical_parameter_name
from longspan.models.mamba import MambaMixer
from longspan.peft.adapters import FINETUNED_BUFFER_SUFFIXES, adapted_layers
from longspan.peft.modules import DoRALinear, LoRALinear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

logger = get_logger(__name__)


def _full(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().to("cpu").contiguous().clone()


def hf_peft_state_dict(model: nn.Module, hf_module_name: Any,
                       hf_row_block: Any = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(peft state dict, HF module names adapted) for ``model``; ``hf_module_name(longspan_name)`` maps a
    longspan linear layer to its HF module path (None: no one-to-one module), ``hf_row_block(longspan_name)``
    to (HF module path, k, n) when its weight is the k-th of n row blocks of that module's (None: neither)."""
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    blocks: dict[str, list[tuple[int, int, str, LoRALinear]]] = {}
    mamba_outputs = {f"{n}.out_proj" for n, m in model.named_modules() if isinstance(m, MambaMixer)}
    for name, layer in adapted_layers(model):
        if name in mamba_outputs:
            raise NotSupportedError(
                f"adapter on {name}: peft refuses adapters on a Mamba mixer's out_proj (transformers' fused Mamba "
                "kernels skip that module), so HF PEFT format cannot hold it; leave out_proj out of "
                "peft.target_modules for an HF adapter, or merge the adapters")
        name = canonical_parameter_name(name)
        hf = hf_module_name(name)
        if hf is None:
            block = hf_row_block(name) if hf_row_block is not None else None
            if block is None:
                raise NotSupportedError(
                    f"adapter on {name}: this model family has no one-to-one Hugging Face module for it "
                    "(transposed, interleaved or per-expert weights), so it cannot be written in HF PEFT format; "
                    "merge the adapters instead")
            blocks.setdefault(block[0], []).append((block[1], block[2], name, layer))
            continue
        tensors.update(_module_tensors(hf, layer, [layer]))
        modules.append(hf)
    for hf, members in blocks.items():
        tensors.update(_module_tensors(hf, members[0][3], _whole_module(hf, members)))
        modules.append(hf)
    return tensors, modules


def _whole_module(hf: str, members: list[tuple[int, int, str, LoRALinear]]) -> list[LoRALinear]:
    """The adapted layers holding HF module ``hf``'s row blocks, in row order; refused unless they are all n
    blocks and share one A (Megatron's adapter on the fused layer): only then is HF's one low-rank pair exact."""
    members = sorted(members, key=lambda member: member[0])
    blocks, n = [k for k, _, _, _ in members], members[0][1]
    names = ", ".join(name for _, _, name, _ in members)
    if blocks != list(range(n)):
        raise NotSupportedError(
            f"adapters on {names}: HF module {hf} fuses {n} row blocks and only {len(blocks)} are adapted; "
            "HF PEFT format needs one adapter over all of them (target the fused layer), or merge the adapters")
    shared = members[0][3].adapter.shared_in
    if any(layer.adapter.shared_in is not shared for _, _, _, layer in members):
        raise NotSupportedError(
            f"adapters on {names}: each has its own A (CanonicalLoRA), which HF module {hf}'s one low-rank pair "
            "cannot hold; use LoRA or DoRA (one A over the fused layer), or merge the adapters")
    return [layer for _, _, _, layer in members]


def _module_tensors(hf: str, owner: LoRALinear, rows: list[LoRALinear]) -> dict[str, torch.Tensor]:
    """HF module ``hf``'s adapter tensors: ``owner``'s A, and B (DoRA: magnitudes) of ``rows`` stacked by rows."""
    prefix = f"base_model.model.{hf}"
    tensors = {
        f"{prefix}.lora_A.weight": _full(owner.adapter.shared_in.weight),
        f"{prefix}.lora_B.weight": torch.cat([_full(layer.adapter.linear_out.weight) for layer in rows]),
    }
    if isinstance(owner, DoRALinear):
        tensors[f"{prefix}.lora_magnitude_vector"] = torch.cat(
            [_full(layer.adapter.weight_magnitude) for layer in rows])
    return tensors


def save_hf_peft_adapter(model: nn.Module | list[nn.Module], peft: Any, bridge: Any, path: str | os.PathLike,
                         base_model_name_or_path: str | None = None) -> None:
    """Write ``peft``'s adapters of ``model`` (one process, one chunk) to ``path`` in HF PEFT format."""
    chunks = model if isinstance(model, list) else [model]
    if len(chunks) != 1:
        raise NotSupportedError("HF PEFT export takes the whole model on one process (one chunk)")
    tensors, modules = hf_peft_state_dict(chunks[0], bridge.hf_module_name, bridge.hf_row_block)
    _warn_finetuned_buffers_left_out(chunks[0])
    os.makedirs(path, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(peft.dim),
        "lora_alpha": peft.alpha,
        "lora_dropout": float(peft.dropout),
        # Only the layers longspan adapted (wildcard targets adapt a subset of layers), by their paths below the
        # top module: peft matches a path's ending, and the checkpoint's top name may not be the loaded model's
        # (NemotronH stores ``backbone.``, transformers loads it as ``model.``; the tensors peft renames itself).
        "target_modules": sorted(m.partition(".")[2] or m for m in modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": peft.kind == "dora",
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    with open(os.path.join(path, ADAPTER_CONFIG), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})


def _warn_finetuned_buffers_left_out(model: nn.Module) -> None:
    """One line when ``model`` has state a finetune changes besides the adapters (the routing bias)."""
    left_out = [n for n, _ in model.named_buffers() if f".{n}".endswith(FINETUNED_BUFFER_SUFFIXES)]
    if left_out:
        logger.warning(
            "HF PEFT adapter export: the finetuned routing bias (router.expert_bias, %d layers) is not part of an "
            "HF adapter (it holds adapter tensors only) and the base's bias is used with it; a merged export "
            "(longspan peft merge, convert export without --adapter-only) carries the finetuned bias", len(left_out))
