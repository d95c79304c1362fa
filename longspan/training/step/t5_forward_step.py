"""The T5 forward step (Megatron's pretrain_t5 contract): span-corruption batches through the encoder-decoder.

Batches come from ``longspan.data.t5_dataset`` (``text_enc``, ``text_dec``, ``labels``, ``loss_mask``,
``enc_mask``, ``dec_mask``; 1 = real token in the masks). The loss is the GPT step's per-token form: the sum
of the decoder's token losses under ``loss_mask`` and their count.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import torch

from longspan.training.step.forward_step import loss_func
from longspan.training.state import GlobalState

T5_BATCH_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask")


def get_t5_batch(data_iterator: Iterator[dict[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """Next T5 microbatch moved to ``device``."""
    batch = next(data_iterator)
    return {k: batch[k].to(device, non_blocking=True) for k in T5_BATCH_KEYS}


def t5_attention_masks(enc_mask: torch.Tensor, dec_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's bool masks (True = masked) ``[b, 1, 1, keys]`` from 0/1 padding masks: padded keys are
    hidden from every query (the decoder adds its causal mask itself); padded queries are left to the loss
    mask, so their rows stay finite."""
    enc_pad = (enc_mask == 0)[:, None, None, :]
    dec_pad = (dec_mask == 0)[:, None, None, :]
    return enc_pad, dec_pad, enc_pad


def t5_forward_step(state: GlobalState, data_iterator: Iterator, model: torch.nn.Module,
                    return_schedule_plan: bool = False) -> tuple[torch.Tensor, Any]:
    """Per-token decoder losses of one T5 microbatch and the loss function that masks them."""
    if return_schedule_plan:
        raise NotImplementedError("return_schedule_plan is a Megatron-internal MoE overlap feature")
    timers = state.timers
    timers("batch-generator", log_level=2).start()
    device = state.device if getattr(state, "device", None) is not None else torch.device("cpu")
    batch = get_t5_batch(data_iterator, device)
    timers("batch-generator").stop()
    encoder_mask, decoder_mask, cross_mask = t5_attention_masks(batch["enc_mask"], batch["dec_mask"])
    # Labels after the target are -1 (megatron-core's padding); the loss mask drops them, the loss needs an id.
    labels = torch.where(batch["loss_mask"] > 0, batch["labels"], torch.zeros_like(batch["labels"]))
    output = model(
        batch["text_enc"],
        batch["text_dec"],
        encoder_attn_mask=encoder_mask,
        decoder_attn_mask=decoder_mask,
        encoder_decoder_attn_mask=cross_mask,
        lm_labels=labels,
    )
    return output, partial(loss_func, batch["loss_mask"])
