"""``tiny-mamba`` and ``tiny-hybrid``: small Mamba-2 models that train on a CPU in minutes (builtin corpus).

Same data, tokenizer, optimizer and schedule as ``tiny``; only the model differs. ``tiny-mamba`` is four
Mamba-2 layers; ``tiny-hybrid`` is Nemotron-H-shaped (``M*M-``: Mamba, attention, Mamba, MLP). Mamba heads (8 of
32 channels in 2 groups) and attention heads divide by 2 and 4, and the 4 layers by pipeline 2 and 4.
"""

from __future__ import annotations

from longspan.models.activations import squared_relu
from longspan.models.mamba_provider import MambaProvider
from longspan.recipes.tiny import SEQ_LENGTH, tiny
from longspan.training.config import ConfigContainer


def _mamba_recipe(model: MambaProvider, run_dir: str) -> ConfigContainer:
    cfg = tiny()
    cfg.model = model
    cfg.logger.tensorboard_dir = f"{run_dir}/tensorboard"
    cfg.checkpoint.save = f"{run_dir}/checkpoints"
    cfg.checkpoint.load = f"{run_dir}/checkpoints"
    return cfg


def _provider(**overrides: object) -> MambaProvider:
    values: dict[str, object] = dict(
        num_layers=4,
        hidden_size=128,
        mamba_num_heads=8,
        mamba_head_dim=32,
        mamba_num_groups=2,
        mamba_state_dim=32,
        mamba_chunk_size=64,
        mamba_conv_kernel=4,
        seq_length=SEQ_LENGTH,
        vocab_size=4096,
        make_vocab_size_divisible_by=128,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        position_embedding_type="none",
        add_bias_linear=False,
        share_embeddings_and_output_weights=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
    )
    values.update(overrides)
    return MambaProvider(**values)  # type: ignore[arg-type]


def tiny_mamba() -> ConfigContainer:
    """4 Mamba-2 layers, hidden 128, d_inner 256 (8 heads × 32), state 32, 2 groups, chunk 64, fp32."""
    return _mamba_recipe(_provider(hybrid_override_pattern="MMMM"), "runs/tiny-mamba")


def tiny_hybrid() -> ConfigContainer:
    """``M*M-``: Mamba-2 layers as in tiny-mamba, one attention layer (8 heads / 4 query groups, no position
    embedding: the Mamba layers carry order) and one squared-ReLU MLP layer (FFN 512), as Nemotron-H."""
    model = _provider(
        hybrid_override_pattern="M*M-", num_attention_heads=8, num_query_groups=4, ffn_hidden_size=512,
        activation_func=squared_relu,
    )
    return _mamba_recipe(model, "runs/tiny-hybrid")
