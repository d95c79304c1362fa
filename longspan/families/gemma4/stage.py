"""What Gemma 4's pipeline stages hand each other beside the hidden states: the per-layer inputs (made on the
first stage from the token ids) and the keys and values the KV-shared layers reuse (made by earlier layers,
possibly on an earlier stage). ``StageCarryWidths`` lays out one token's slot of that tensor; the provider
reports its width to the pipeline layer and ``longspan.families.gemma4.model.StageCarry`` packs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class StageCarryWidths:
    """What one token's slot in the tensor between pipeline stages holds, in this order (widths): the hidden
    states; every layer's per-layer input (``num_layers * per_layer_embed_dim``, 0 without them); with KV
    sharing the keys, then the values, of the sliding-window layers and then of the full-attention layers
    that KV-shared layers reuse (this tensor-parallel rank's groups times the head width, each); then, for a model
    whose image tokens attend both ways (``use_bidirectional_attention='vision'``), one slot saying whether the
    token is an image token (later stages build the image blocks' mask from it: they get no token ids). The width
    is the same at every stage boundary (zeros where nothing is produced yet), so any cut works."""

    hidden: int
    per_layer: int
    sliding_kv: tuple[int, int]
    """(KV groups on this tensor-parallel rank, head width) of the sliding-window layers; (0, 0) without KV
    sharing."""
    full_kv: tuple[int, int]
    """The same for the full-attention layers."""
    image: int = 0
    """1 when the stages hand on which tokens are image tokens, else 0."""

    @classmethod
    def of(cls, provider: Any) -> "StageCarryWidths":
        tp = int(provider.tensor_model_parallel_size or 1)
        heads = int(provider.num_attention_heads)
        local_dim = int(provider.kv_channels or provider.hidden_size // heads)
        local_groups = int(provider.num_query_groups or heads)
        sliding, full = (0, 0), (0, 0)
        if provider.num_kv_shared_layers:
            sliding = (local_groups // tp, local_dim)
            full = (int(provider.num_global_query_groups or local_groups) // tp,
                    int(provider.global_kv_channels or local_dim))
        per_layer = int(provider.num_layers) * int(provider.per_layer_embed_dim or 0)
        return cls(int(provider.hidden_size), per_layer, sliding, full, int(provider.stage_carries_image_tokens()))

    @property
    def total(self) -> int:
        return self.hidden + self.per_layer + 2 * (self.sliding_kv[0] * self.sliding_kv[1]
                                                   + self.full_kv[0] * self.full_kv[1]) + self.image


def stage_carry_problem(provider: Any) -> Optional[str]:
    """Why the pipeline stages of ``provider``'s layout cannot exchange the per-layer inputs, shared keys and
    values and image-token slots (one line), or None: they travel beside the hidden states, token by token,
    which needs both cut alike; sequence parallel splits the hidden states over the tensor-parallel ranks and
    not the keys and values, and context parallel (its attention over the whole sequence) is not proven with
    them yet."""
    pp = int(provider.pipeline_model_parallel_size or 1)
    split = {"sequence_parallel": bool(provider.sequence_parallel),
             "context_parallel_size": int(provider.context_parallel_size or 1) > 1}
    for name, splits in split.items():
        if splits:
            value = getattr(provider, name)
            return (f"pipeline_model_parallel_size={pp} with model.{name}={value!r} is not supported yet for Gemma 4 "
                    f"with num_kv_shared_layers={provider.num_kv_shared_layers} / per_layer_embed_dim="
                    f"{provider.per_layer_embed_dim} / image tokens attending both ways="
                    f"{provider.stage_carries_image_tokens()} (the stages would exchange them split otherwise than "
                    "the hidden states)")
    return None


__all__ = ["StageCarryWidths", "stage_carry_problem"]
