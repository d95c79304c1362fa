"""The default GPT forward step and loss function (Megatron's contract).

A forward step is called once per microbatch as ``forward_step(state, data_iterator, model)`` (or without
``state``, see ``prepare_forward_step_func``) and returns ``(output_tensor, loss_func)``;
``loss_func(output_tensor)`` returns ``(loss_sum, num_tokens, {name: tensor([sum, count])})`` (per-token
form) or ``(loss, {name: value})`` (legacy per-microbatch form).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import torch

from longspan.config.rules.model import provider_field
from longspan.config.schema.data import FinetuningDatasetConfig, GPTDatasetConfig, PackedSequenceSpecs
from longspan.config.schema.data_hf import DirectHFSFTDatasetConfig
from longspan.data.sft.dataset import pad_token_id
from longspan.data.sft.in_batch_packing import pack_padded_batch
from longspan.training.state import GlobalState

# The HF processor's image inputs of multimodal batches (longspan.data.sft.multimodal), under HF's names: the
# vision-language models take them as keyword arguments of these names.
IMAGE_BATCH_KEYS = ("pixel_values", "image_grid_thw", "image_position_ids", "token_type_ids", "pixel_values_videos",
                    "video_grid_thw")
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask", "cu_seqlens", "sequence_lengths",
              *IMAGE_BATCH_KEYS)


def get_batch(data_iterator: Iterator[dict[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """Next microbatch moved to ``device`` (non-blocking when pinned)."""
    batch = next(data_iterator)
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if k in BATCH_KEYS and v is not None}


def masked_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Σ(loss·mask), Σmask and the ``lm loss`` report [Σ, count] for one microbatch."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.view(1).to(loss.dtype)])
    return loss, num_tokens, {"lm loss": report}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Megatron's GPT loss function (the per-token form)."""
    return masked_loss(loss_mask, output_tensor)


def forward_step(state: GlobalState, data_iterator: Iterator, model: torch.nn.Module, return_schedule_plan: bool = False) -> tuple[torch.Tensor, Any]:
    """Default GPT forward step: per-token losses from the model and a loss function masking them."""
    if return_schedule_plan:
        raise NotImplementedError("return_schedule_plan is a Megatron-internal MoE overlap feature")
    timers = state.timers
    timers("batch-generator", log_level=2).start()
    device = state.device if getattr(state, "device", None) is not None else torch.device("cpu")
    batch = _pack_in_step(state, get_batch(data_iterator, device))
    timers("batch-generator").stop()
    # GPT datasets build a plain causal mask unless reset_attention_mask, and unpacked SFT batches are
    # right-padded: the model's causal fast path is the same maths without materializing [s, s] masks.
    attention_mask = batch.get("attention_mask") if _needs_explicit_mask(state) else None
    images = {k: batch[k] for k in IMAGE_BATCH_KEYS if k in batch}
    output = model(
        batch["tokens"],
        position_ids=_position_ids(state, batch),
        attention_mask=attention_mask,
        labels=batch["labels"],
        **_mtp_inputs(state, batch),
        **images,
    )
    return output, partial(loss_func, batch["loss_mask"])


def _position_ids(state: GlobalState, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The batch's positions; a batch with images' patch grids is numbered here by the vision-language provider
    (mRoPE's ``[3, b, s]``; packed documents, ``cu_seqlens``, each from 0), so every pipeline stage gets the
    same ids (later stages do not see the images)."""
    if "image_grid_thw" not in batch and "video_grid_thw" not in batch:
        return batch.get("position_ids")
    positions = state.cfg.model.image_position_ids(batch["tokens"], batch.get("image_grid_thw"),
                                                   batch.get("video_grid_thw"), batch.get("cu_seqlens"))
    return batch.get("position_ids") if positions is None else positions


def _mtp_inputs(state: GlobalState, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Multi-token prediction shifts the loss mask (and, for packed documents, stops at their boundaries); gated
    DeltaNet layers restart their state at the packed documents' boundaries. The model gets these only when it
    has MTP depths or such layers, so other models' forward signatures stay as they are."""
    model_cfg = state.cfg.model
    mtp = bool(model_cfg.mtp_num_layers)
    inputs = {"loss_mask": batch["loss_mask"]} if mtp else {}
    linear = provider_field(model_cfg, "experimental_attention_variant", None) is not None
    if (mtp or linear) and batch.get("cu_seqlens") is not None:
        inputs["cu_seqlens"] = batch["cu_seqlens"]
    return inputs


def _pack_in_step(state: GlobalState, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Deferred in-batch packing (``dataset.defer_in_batch_packing_to_step``): the padded microbatch, with its
    samples' ``sequence_lengths``, becomes one packed sequence here, as the collate would have packed it."""
    if "sequence_lengths" not in batch:
        return batch
    dataset_cfg = state.cfg.dataset
    tokenizer = state.tokenizer
    pad_id = pad_token_id(tokenizer) if tokenizer is not None else 0
    return pack_padded_batch(batch, pad_id, int(dataset_cfg.in_batch_packing_pad_to_multiple_of))


def _needs_explicit_mask(state: GlobalState) -> bool:
    """Document masks: GPT data with reset_attention_mask, or packed SFT data (block-diagonal per pack, offline
    or in-batch)."""
    dataset_cfg = state.cfg.dataset
    if isinstance(dataset_cfg, GPTDatasetConfig):
        return bool(dataset_cfg.reset_attention_mask)
    if isinstance(dataset_cfg, DirectHFSFTDatasetConfig):
        return bool(dataset_cfg.enable_in_batch_packing)
    if not isinstance(dataset_cfg, FinetuningDatasetConfig):
        return False
    specs = dataset_cfg.packed_sequence_specs
    if isinstance(specs, dict):
        size = specs.get("packed_sequence_size")
    else:
        size = specs.packed_sequence_size if isinstance(specs, PackedSequenceSpecs) else None
    return bool(size is not None and size > 0)
