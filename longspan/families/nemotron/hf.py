"""Nemotron-H and Nemotron 3 (``NemotronHForCausalLM``): hybrid stacks of Mamba-2 mixers, attention, MLP and
mixture-of-experts layers, as config.json and weights.

Nemotron 3's MoE layers ('E', ``moe`` in ``layers_block_type``) are longspan's shared MoE layer: squared-ReLU
experts without a gate, one always-on shared expert (``moe_shared_expert_intermediate_size``), sigmoid routing
with the aux-loss-free expert bias (``e_score_correction_bias``), group-limited top-k (``n_group`` /
``topk_group``), the chosen scores normalized and scaled by ``routed_scaling_factor``, and the latent space
(``moe_latent_size``: ``fc1_latent_proj`` before dispatch, ``fc2_latent_proj`` after the combine, the router and
the shared expert on the full hidden state, as transformers' NemotronHMoE and Megatron's MoELayer).

Multi-token prediction (``num_nextn_predict_layers`` > 0, Nemotron 3 Super's ``mtp.*`` tensors with their own
``mtp_layers_block_type``) is refused: transformers' NemotronH has no MTP module (it drops ``mtp.*`` on load), so
there is no reference implementation to hold longspan's to.
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import dtype_fields, required
from longspan.conversion.expert_bias_moe import sigmoid_routing_fields, sigmoid_routing_hf_fields
from longspan.conversion.families import Family
from longspan.conversion.mamba_fields import mamba_mixer_fields, mamba_mixer_hf, mamba_stack_fields, mixer_sizes
from longspan.conversion.mapping import WeightMap, mamba_mixer
from longspan.core.errors import NotSupportedError
from longspan.models.activations import squared_relu
from longspan.models.layer_pattern import layer_windows
from longspan.models.mamba import allocate_layers
from longspan.models.mamba_provider import MambaProvider


# Every block is ``norm`` + ``mixer`` (Mamba-2, attention or MLP), so one HF norm name per layer stands for
# longspan's Mamba ``norm``, attention ``input_layernorm`` or MLP ``pre_mlp_layernorm``.
def _layer(ours: str, hf: str, **kw: Any) -> WeightMap:
    return WeightMap(f"decoder.layers.{{i}}.{ours}", f"backbone.layers.{{i}}.{hf}", **kw)


# The MoE layer: HF's ``mixer`` is longspan's ``mlp`` (a MoELayer); one HF tensor per routed expert.
MOE_LAYER = (
    _layer("mlp.router.weight", "mixer.gate.weight"),
    _layer("mlp.router.expert_bias", "mixer.gate.e_score_correction_bias", buffer=True),
    _layer("mlp.experts.linear_fc1.weight", "mixer.experts.{e}.up_proj.weight", per_expert=True),
    _layer("mlp.experts.linear_fc2.weight", "mixer.experts.{e}.down_proj.weight", per_expert=True),
    _layer("mlp.shared_experts.linear_fc1.weight", "mixer.shared_experts.up_proj.weight"),
    _layer("mlp.shared_experts.linear_fc2.weight", "mixer.shared_experts.down_proj.weight"),
    _layer("mlp.fc1_latent_proj.weight", "mixer.fc1_latent_proj.weight"),
    _layer("mlp.fc2_latent_proj.weight", "mixer.fc2_latent_proj.weight"),
)


def nemotron_h(d_inner: int, bc_rows: int, heads: int) -> tuple[WeightMap, ...]:
    """Nemotron-H's weight table for Mamba mixers of these sizes. transformers writes its checkpoints with
    NVIDIA's original "backbone." prefix (its module is "model.")."""
    return (
        WeightMap("embedding.word_embeddings.weight", "backbone.embeddings.weight", vocab=True),
        WeightMap("decoder.final_norm.weight", "backbone.norm_f.weight"),
        WeightMap("output_layer.weight", "lm_head.weight", vocab=True),
        _layer("norm.weight", "norm.weight"),
        _layer("input_layernorm.weight", "norm.weight"),
        _layer("pre_mlp_layernorm.weight", "norm.weight"),
        *mamba_mixer("decoder.layers.{i}.mixer", "backbone.layers.{i}.mixer", d_inner, bc_rows, heads),
        _layer("self_attention.linear_q.weight", "mixer.q_proj.weight"),
        _layer("self_attention.linear_k.weight", "mixer.k_proj.weight"),
        _layer("self_attention.linear_v.weight", "mixer.v_proj.weight"),
        _layer("self_attention.linear_proj.weight", "mixer.o_proj.weight"),
        _layer("mlp.linear_fc1.weight", "mixer.up_proj.weight"),
        _layer("mlp.linear_fc2.weight", "mixer.down_proj.weight"),
        *MOE_LAYER,
    )


def nemotron_h_weights(cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
    """Nemotron-H's table for config.json ``cfg``: the fused in_proj / conv1d split by its mixer sizes."""
    return nemotron_h(*mixer_sizes(cfg, "mamba_num_heads", "mamba_head_dim", "ssm_state_size"))


_SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}


_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _pattern(cfg: dict[str, Any]) -> str:
    """The hybrid_override_pattern of config.json's ``layers_block_type`` (or its own pattern)."""
    types = cfg.get("layers_block_type")
    if not types:
        return required(cfg, "hybrid_override_pattern")
    unknown = sorted(set(types) - set(_SYMBOLS))
    if unknown:
        raise NotSupportedError(f"config.json layers_block_type has {unknown}: longspan reads {sorted(_SYMBOLS)}")
    return "".join(_SYMBOLS[t] for t in types)


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """MambaProvider MoE fields of a Nemotron 3 config.json (its pattern has 'E' layers): the shared sigmoid
    routing's, the shared expert's width and the latent size. transformers reads
    ``moe_shared_expert_intermediate_size`` itself (not ``n_shared_experts``) and ``mlp_hidden_act`` for every
    expert."""
    out = sigmoid_routing_fields(cfg)
    latent = cfg.get("moe_latent_size")
    out.update(
        moe_shared_expert_intermediate_size=required(cfg, "moe_shared_expert_intermediate_size"),
        moe_latent_size=None if latent is None else int(latent),
    )
    return out


def nemotron_h_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """MambaProvider keyword arguments of a Nemotron-H / Nemotron 3 config.json."""
    pattern = _pattern(cfg)
    for key in ("attention_bias", "mlp_bias", "sliding_window"):
        if cfg.get(key):
            raise NotSupportedError(f"config.json {key}={cfg[key]!r} is not supported for Nemotron-H")
    if cfg.get("num_nextn_predict_layers"):
        raise NotSupportedError(
            f"config.json num_nextn_predict_layers={cfg['num_nextn_predict_layers']} is not supported yet: "
            "transformers' NemotronH has no multi-token-prediction layers (it drops the mtp.* weights), so "
            "longspan has no reference for them; use a checkpoint without MTP or set it to 0"
        )
    if cfg.get("mlp_hidden_act", "relu2") != "relu2":
        raise NotSupportedError(f"config.json mlp_hidden_act={cfg['mlp_hidden_act']!r} is not supported: use relu2")
    vocab = required(cfg, "vocab_size")
    heads = required(cfg, "num_attention_heads")
    out = dict(
        num_layers=len(pattern),
        hybrid_override_pattern=pattern,
        hidden_size=required(cfg, "hidden_size"),
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or required(cfg, "hidden_size") // heads,
        ffn_hidden_size=required(cfg, "intermediate_size"),
        activation_func=squared_relu,
        gated_linear_unit=False,
        add_bias_linear=False,
        seq_length=int(cfg.get("max_position_embeddings", 4096)),
        **mamba_stack_fields(cfg, vocab),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        hidden_dropout=float(cfg.get("hidden_dropout", 0.0)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        # transformers' Nemotron-H clamps softplus(dt) at time_step_min (its time_step_limit field is unused)
        mamba_dt_limit_min=float(cfg.get("time_step_min", 0.001)),
    )
    out.update(mamba_mixer_fields(cfg, "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "mamba_hidden_act",
                                  None))
    if "E" in pattern:
        out.update(_moe_fields(cfg))
    out.update(dtype_fields(cfg))
    return out


def _check_exportable(p: Any, pattern: str) -> None:
    """One-line NotSupportedError for what a Nemotron-H config.json cannot hold."""
    if any(kind == "*" and window is not None for kind, window in zip(pattern, layer_windows(p))):
        raise NotSupportedError("Nemotron-H attention has no sliding window: export a model without window_size")
    if p.apply_residual_connection_post_layernorm and ("*" in pattern or "-" in pattern):
        raise NotSupportedError("Nemotron-H layers add to their input: export a model without "
                                "apply_residual_connection_post_layernorm")
    if p.normalization != "RMSNorm" or p.add_bias_linear or p.gated_linear_unit:
        raise NotSupportedError("Nemotron-H needs RMSNorm, no linear biases and a plain (ungated) MLP")
    if ("-" in pattern or "E" in pattern) and p.activation_func is not squared_relu:
        raise NotSupportedError("Nemotron-H's MLP and expert layers use squared ReLU: set activation_func to "
                                "squared_relu")
    if "E" in pattern and not p.moe_shared_expert_intermediate_size:
        raise NotSupportedError("Nemotron-H's MoE layers always have a shared expert: set "
                                "model.moe_shared_expert_intermediate_size")


def _moe_hf(p: Any, pattern: str) -> dict[str, Any]:
    """The config.json MoE keys of provider ``p`` (none without 'E' layers)."""
    if "E" not in pattern:
        return {}
    out = sigmoid_routing_hf_fields(p)
    out.update(n_shared_experts=1, moe_shared_expert_intermediate_size=p.moe_shared_expert_intermediate_size,
               moe_latent_size=p.moe_latent_size)
    return out
    if p.position_embedding_type != "none":
        raise NotSupportedError("Nemotron-H attention has no position embedding: set position_embedding_type='none'")


def nemotron_h_hf(p: Any) -> dict[str, Any]:
    """A Nemotron-H config.json body for provider ``p``."""
    pattern = "".join(allocate_layers(p.num_layers, p.hybrid_attention_ratio, p.hybrid_mlp_ratio,
                                      p.hybrid_override_pattern))
    _check_exportable(p, pattern)
    mixer = mamba_mixer_hf(p, "Nemotron-H")
    heads = mixer.pop("heads")
    return dict(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, layers_block_type=[_TYPES[c] for c in pattern],
        num_attention_heads=p.num_attention_heads, num_key_value_heads=p.num_query_groups or p.num_attention_heads,
        head_dim=p.kv_channels or p.hidden_size // p.num_attention_heads, intermediate_size=p.ffn_hidden_size,
        mlp_hidden_act="relu2", max_position_embeddings=p.seq_length, mamba_num_heads=heads,
        mamba_head_dim=p.mamba_head_dim, ssm_state_size=p.mamba_state_dim, mamba_hidden_act="silu",
        time_step_min=float(p.mamba_dt_limit_min), mamba_proj_bias=False, attention_bias=False, mlp_bias=False,
        layer_norm_epsilon=p.layernorm_epsilon, residual_in_fp32=False,
        tie_word_embeddings=bool(p.share_embeddings_and_output_weights), attention_dropout=float(p.attention_dropout),
        hidden_dropout=float(p.hidden_dropout), initializer_range=float(p.init_method_std), **mixer,
        **_moe_hf(p, pattern),
    )


NEMOTRON_H = Family("nemotron_h", "NemotronHForCausalLM", "nemotron_h", nemotron_h(1, 1, 1), nemotron_h_provider,
                    nemotron_h_hf, MambaProvider, nemotron_h_weights)
