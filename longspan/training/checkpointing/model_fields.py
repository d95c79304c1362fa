"""Model fields a pretrained checkpoint fills in, and the values set on purpose that it must not replace.

An HF ``config.json`` (``checkpoint.pretrained_checkpoint``) or a longspan ``run_config.yaml``
(``checkpoint.use_checkpoint_args``) describes the model its weights belong to. The rule, per field:

- the run's own fields (layout, precision, ...; the caller names them) never change;
- a value set on purpose (a YAML file or a dotlist override; see ``longspan.config.explicit``) stays, unless
  it contradicts the weights' shapes (``SHAPE_FIELDS``): then the run stops in one line naming both values;
- a recipe's value stays for the training choices (``TRAINING_CHOICE_FIELDS``: dropouts, initialization,
  recomputation, fusions, auxiliary loss weights); its architecture is a template the checkpoint replaces
  (the finetuning recipes carry a placeholder model);
- everything else comes from the checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable

from longspan.config.explicit import explicit_fields, is_recipe_source
from longspan.core.errors import ConfigError

#: fields the weights' shapes (or the parameters that exist) fix
SHAPE_FIELDS = frozenset({
    "num_layers", "encoder_num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "num_query_groups", "kv_channels", "vocab_size", "num_moe_experts", "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size", "moe_layer_freq", "moe_shared_expert_gate",
    "moe_router_enable_expert_bias", "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
    "normalization", "share_embeddings_and_output_weights", "position_embedding_type", "multi_latent_attention",
    "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mamba_num_groups",
    "mamba_state_dim", "mamba_head_dim", "mamba_num_heads", "mamba_conv_kernel", "mamba_expand",
    "hybrid_override_pattern", "relative_attention_num_buckets", "moe_latent_size",
})
#: with learned absolute positions the position table has this many rows
LEARNED_POSITION_FIELDS = frozenset({"seq_length", "max_position_embeddings"})

#: a recipe's value of these stays (they change training, not the function the weights compute)
TRAINING_CHOICE_FIELDS = frozenset({
    "hidden_dropout", "attention_dropout", "init_method_std", "embedding_init_method_std",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
    "distribute_saved_activations", "calculate_per_token_loss", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_input_jitter_eps", "moe_router_bias_update_rate", "moe_layer_recompute", "attention_backend",
    "bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion", "apply_rope_fusion",
    "persist_layer_norm", "memory_efficient_layer_norm", "moe_permute_fusion", "moe_grouped_gemm",
    "cross_entropy_loss_fusion", "enable_cuda_graph", "cuda_graph_warmup_steps",
})


@dataclass
class ModelFieldMerge:
    """What a pretrained checkpoint's model config did to the run's model section."""

    changed: list[str] = field(default_factory=list)
    """Fields set from the checkpoint (their values differed), in field order."""

    kept: dict[str, tuple[Any, str]] = field(default_factory=dict)
    """Fields that kept a value set on purpose although the checkpoint says otherwise: name -> (value, source)."""

    def describe(self, origin: str) -> str:
        """``model fields from ORIGIN: a, b; kept as set: x=1 (override)`` for the start-up line."""
        text = f"model fields from {origin}: {', '.join(self.changed) or 'none changed'}"
        if self.kept:
            text += "; kept as set: " + ", ".join(f"{name}={value!r} ({source})"
                                                for name, (value, source) in self.kept.items())
        return text


def vision_language_family_of(cfg: Any, source_model: Any, run_fields: Iterable[str]) -> Any:
    """The VLM recipes' model is a placeholder of one family; the pretrained checkpoint's family replaces it.
    Returns a copy of ``source_model`` holding the run's fields (``run_fields``) and the values set on purpose
    (not by the recipe) that the new family has; the merge then checks those against the checkpoint as usual."""
    run_fields = set(run_fields)
    explicit = explicit_fields(cfg, "model")
    model = copy.copy(source_model)
    for f in dataclasses.fields(cfg.model):
        who = explicit.get(f.name)
        chosen = f.name in run_fields or (who is not None and not is_recipe_source(who))
        if chosen and hasattr(model, f.name):
            setattr(model, f.name, getattr(cfg.model, f.name))
    return model


def merge_pretrained_model_fields(cfg: Any, source_model: Any, origin: str, where: str,
                                  run_fields: Iterable[str]) -> ModelFieldMerge:
    """Apply ``source_model``'s fields to ``cfg.model`` by the rule of this module (``origin``: ``config.json``,
    ``where``: the directory, both for messages); ``run_fields`` never change."""
    model = cfg.model
    run_fields = set(run_fields)
    shapes = SHAPE_FIELDS | (LEARNED_POSITION_FIELDS if source_model.position_embedding_type == "learned_absolute"
                             else frozenset())
    explicit = explicit_fields(cfg, "model")
    merge = ModelFieldMerge()
    for f in dataclasses.fields(source_model):
        if f.name in run_fields or not hasattr(model, f.name):
            continue
        theirs, ours = getattr(source_model, f.name), getattr(model, f.name)
        if ours == theirs:
            continue
        who = explicit.get(f.name)
        by_user = who is not None and not is_recipe_source(who)
        if f.name in shapes:
            if by_user and ours is not None and theirs is not None:
                raise ConfigError(
                    f"model.{f.name}={ours!r} (set by you, {who}) contradicts {origin} {f.name}={theirs!r} in "
                    f"{where}: the weights have that shape; drop the setting to take the checkpoint's")
            keep = by_user and theirs is None
        else:
            keep = by_user or (who is not None and f.name in TRAINING_CHOICE_FIELDS)
        if keep:
            merge.kept[f.name] = (ours, who)
        else:
            setattr(model, f.name, theirs)
            merge.changed.append(f.name)
    return merge
