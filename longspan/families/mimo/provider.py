"""``MiMoV2FlashModelProvider``: Xiaomi's MiMo-V2-Flash (HF ``MiMoV2FlashForCausalLM``); ``provide()`` builds
``longspan.families.mimo.model.MiMoV2FlashModel``.

The GPT fields describe the full-attention layers (``num_query_groups``, ``softmax_type``, ``rotary_base[1]``);
the ``window_*`` fields below say how the sliding-window layers (``window_size`` / ``window_attn_skip_freq``)
differ. Every layer's values are ``v_head_dim`` wide (the MLA field, read here by the plain attention too) while
queries and keys are ``kv_channels`` wide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional

from longspan.models.gpt_provider import GPTModelProvider


@dataclass
class MiMoV2FlashModelProvider(GPTModelProvider):
    """A MiMo-V2-Flash model: sliding-window layers with their own KV groups and attention sinks beside
    full-attention layers, values narrower than queries and keys and scaled by a constant, RoPE per layer kind."""

    v_head_dim: Optional[int] = None  # type: ignore[assignment]
    """Width of each value head (HF ``v_head_dim``), on every layer; None = ``kv_channels``. The attention
    output is ``num_attention_heads * v_head_dim`` wide."""

    window_num_query_groups: Optional[int] = None
    """Key/value groups of the sliding-window layers (transformers' MiMo-V2-Flash: ``2 * num_key_value_heads``);
    None = ``num_query_groups``."""

    window_softmax_type: Optional[Literal["vanilla", "off-by-one", "learnable"]] = None
    """``softmax_type`` of the sliding-window layers (HF's ``attention_sink_bias``, learned sinks there only:
    'learnable'); None = ``softmax_type``."""

    attention_value_scale: Optional[float] = None
    """Constant every value is multiplied by before attention (and before the KV cache; HF
    ``attention_value_scale``); None = 1."""

    hf_architecture: ClassVar[str] = "MiMoV2FlashForCausalLM"

    def build_model(self, pre_process: bool, post_process: bool, vp_stage: Optional[int],
                    layer_numbers: Optional[list[int]], materialize: bool) -> Any:
        """``longspan.families.mimo.model.build_mimo_model`` (see ``ModelProviderMixin``)."""
        from longspan.families.mimo.model import build_mimo_model  # keeps the provider free of model code

        return build_mimo_model(self, pre_process, post_process, vp_stage, materialize=materialize,
                                layer_numbers=layer_numbers)


__all__ = ["MiMoV2FlashModelProvider"]
