"""``Gemma4ModelProvider``: Gemma 4's text model (Megatron Bridge's provider name); ``provide()`` builds
``longspan.families.gemma4.model.Gemma4Model``.

The GPT fields describe the sliding-window layers (``kv_channels``, ``num_query_groups``, ``rotary_base[0]``);
the fields below say how the full-attention layers differ, which layers reuse another layer's keys and values,
and the per-layer input embeddings. Always part of the model (no field): a scale-free RMSNorm on the values,
a learned scalar per layer (``layer_scalar``) multiplying its output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.families.gemma4.stage import StageCarryWidths, stage_carry_problem
from longspan.models.gpt_provider import GPTModelProvider


@dataclass
class Gemma4ModelProvider(GPTModelProvider):
    """A Gemma 4 text model: sliding-window and full-attention layers with their own head widths, KV groups and
    RoPE; keys reused as values on full-attention layers; the last layers reusing earlier layers' keys and
    values; per-layer input embeddings; final logit soft-capping."""

    global_kv_channels: Optional[int] = None
    """Head width of the full-attention layers (HF ``global_head_dim``); None = ``kv_channels``."""

    num_global_query_groups: Optional[int] = None
    """Key/value groups of the full-attention layers (HF ``num_global_key_value_heads``); None =
    ``num_query_groups``."""

    global_rotary_percent: float = 1.0
    """Fraction of a full-attention head's channel pairs that rotate (HF's proportional RoPE
    ``partial_rotary_factor``): the first ``int(p * d / 2)`` frequencies of a width-``d`` head keep their
    full-width values ``base^(-2i/d)``, the others are zero (those channels do not rotate)."""

    attention_k_eq_v: bool = False
    """Full-attention layers have no value projection: the values are the key projection's output (before
    the key norm and RoPE), through the scale-free value norm."""

    num_kv_shared_layers: int = 0
    """The last this many layers compute no keys or values: each attends with those of the last earlier layer
    of its kind (sliding window or full), and holds no KV cache of its own. Must be below ``num_layers``."""

    use_double_wide_mlp: bool = False
    """The MLP of the KV-shared layers is twice ``ffn_hidden_size`` wide."""

    per_layer_embed_dim: Optional[int] = None
    """Width of the per-layer input embeddings (HF ``hidden_size_per_layer_input``); None/0 = none. Each layer
    gets ``(norm(proj(x) / sqrt(hidden)) + embed_i(token) * sqrt(dim)) / sqrt(2)`` as its slice ``i``, gated
    by the layer's output and projected back into the residual stream after the MLP."""

    per_layer_embed_vocab_size: Optional[int] = None
    """Rows of the per-layer input embedding table (HF ``vocab_size_per_layer_input``); None = ``vocab_size``."""

    hf_architecture: ClassVar[str] = "Gemma4ForCausalLM"

    def finalize(self) -> None:
        """``GPTModelProvider.finalize``, then what the layout cannot hold, at config validation (so ``longspan
        plan`` rejects such layouts and a run stops before it starts): a one-line ConfigError when tensor
        parallel does not divide the full-attention layers' KV groups, NotSupportedError for sequence parallel
        with per-layer inputs, and for pipeline parallel
        with KV sharing, per-layer inputs or two-way image blocks in a layout whose stages cannot exchange them
        (``stage_carry_problem``)."""
        super().finalize()
        tp, pp = int(self.tensor_model_parallel_size or 1), int(self.pipeline_model_parallel_size or 1)
        groups = self.num_global_query_groups or self.num_query_groups
        if groups and groups % tp:
            raise ConfigError(f"model.num_global_query_groups={groups} with tensor_model_parallel_size={tp}: tensor "
                              "parallel splits whole KV groups of the full-attention layers; use a tp that divides it")
        if self.sequence_parallel and self.per_layer_embed_dim:
            raise NotSupportedError(f"model.sequence_parallel=True with model.per_layer_embed_dim="
                                    f"{self.per_layer_embed_dim} is not supported yet for Gemma 4: sequence parallel "
                                    "does not split the per-layer inputs; run it without sequence parallel")
        if pp > 1 and self.stages_exchange_more_than_hidden():
            problem = stage_carry_problem(self)
            if problem is not None:
                raise NotSupportedError(problem)

    def set_num_layers(self, num_layers: int) -> None:
        """A probe of fewer layers shares no keys and values: its layers keep their own (the planner's estimate
        of a layer is then its upper bound)."""
        super().set_num_layers(num_layers)
        if self.num_kv_shared_layers >= num_layers:
            self.num_kv_shared_layers = 0

    def stages_exchange_more_than_hidden(self) -> bool:
        """Whether pipeline stages hand on more than the hidden states (``StageCarry``): the keys and values of
        KV sharing, the per-layer inputs or the image-token slots."""
        return bool(self.num_kv_shared_layers or self.per_layer_embed_dim or self.stage_carries_image_tokens())

    def stage_carries_image_tokens(self) -> bool:
        """Whether pipeline stages hand on which tokens are image tokens (``StageCarryWidths.image``): never for
        the text model."""
        return False

    def pipeline_activation_width(self) -> int:
        """Per token, the width of what pipeline stages exchange (``longspan.parallel.pipeline.activation_spec``):
        the hidden states, then the per-layer inputs and the shared keys and values a later stage needs
        (``StageCarryWidths``)."""
        return StageCarryWidths.of(self).total

    def build_model(self, pre_process: bool, post_process: bool, vp_stage: Optional[int],
                    layer_numbers: Optional[list[int]], materialize: bool) -> Any:
        """``longspan.families.gemma4.model.build_gemma4_model`` (see ``ModelProviderMixin``)."""
        from longspan.families.gemma4.model import build_gemma4_model  # keeps the provider free of model code

        return build_gemma4_model(self, pre_process, post_process, vp_stage, materialize=materialize,
                                  layer_numbers=layer_numbers)


__all__ = ["Gemma4ModelProvider"]
