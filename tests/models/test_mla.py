"""Multi-latent attention (longspan.models.mla): the module's maths against a hand-written reference, the
config rules' one-line errors, and the latent KV cache (its size against plain grouped-query attention)."""

from __future__ import annotations

import math

import pytest
import torch

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.gpt import build_gpt_model, resolve_model_args
from longspan.models.transformer import KVCache
from tests.models.gpt_test_config import llama_config

MLA = dict(multi_latent_attention=True, num_query_groups=None, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12,
           qk_pos_emb_head_dim=8, v_head_dim=10, qk_layernorm=True)


def mla_config(**overrides):
    return llama_config(**{**MLA, **overrides})


def _reference_attention(attn, x, cos, sin, scale):
    """MLA written out from the paper's equations, per head, with a dense causal softmax."""
    b, s, _ = x.shape
    m = attn.mla
    heads = attn.linear_kv_up_proj.weight.shape[0] // (m.qk_head_dim + m.v_head_dim)
    if attn.linear_q_proj is not None:
        q = attn.linear_q_proj(x)
    else:
        q = attn.linear_q_up_proj(attn.q_layernorm(attn.linear_q_down_proj(x)))
    q = q.view(b, s, heads, -1)
    down = attn.linear_kv_down_proj(x)
    c_kv, k_pe = attn.kv_layernorm(down[..., :m.kv_lora_rank]), down[..., m.kv_lora_rank:]

    def rope(t):  # interleaved pairs (t[2i], t[2i+1]) rotate by frequency i, written out de-interleaved
        even, odd = t[..., 0::2], t[..., 1::2]
        c, sn = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        return torch.cat([even * c - odd * sn, odd * c + even * sn], dim=-1)

    q_pe = rope(q[..., m.qk_head_dim:])
    k_pe = rope(k_pe.unsqueeze(2)).expand(b, s, heads, -1)
    kv = attn.linear_kv_up_proj(c_kv).view(b, s, heads, -1)
    k = torch.cat([kv[..., :m.qk_head_dim], k_pe], dim=-1)
    v = kv[..., m.qk_head_dim:]
    q = torch.cat([q[..., :m.qk_head_dim], q_pe], dim=-1)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, -1)
    return attn.linear_proj(out)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_attention_equals_the_written_out_maths(q_lora_rank):
    torch.manual_seed(0)
    model = build_gpt_model(mla_config(q_lora_rank=q_lora_rank, mscale_all_dim=0.7, rotary_scaling_factor=5.0),
                            seed=1)
    attn = model.decoder.layers["0"].self_attention
    x = torch.randn(2, 9, 64)
    cos, sin = model.rotary_pos_emb(torch.arange(9)[None])
    mscale = 0.1 * 0.7 * math.log(5.0) + 1.0
    expected = _reference_attention(attn, x, cos, sin, mscale**2 / math.sqrt(12 + 8))
    with torch.no_grad():
        assert torch.allclose(attn(x, (cos, sin)), expected, atol=1e-5, rtol=0)


def test_module_names_and_shapes():
    model = build_gpt_model(mla_config(), seed=0)
    shapes = {n.removeprefix("decoder.layers.0.self_attention."): tuple(p.shape)
              for n, p in model.named_parameters() if n.startswith("decoder.layers.0.self_attention.")}
    assert shapes == {
        "linear_q_down_proj.weight": (24, 64), "q_layernorm.weight": (24,),
        "linear_q_up_proj.weight": (4 * 20, 24), "linear_kv_down_proj.weight": (16 + 8, 64),
        "kv_layernorm.weight": (16,), "linear_kv_up_proj.weight": (4 * (12 + 10), 16),
        "linear_proj.weight": (64, 4 * 10),
    }
    no_norms = build_gpt_model(mla_config(qk_layernorm=False, q_lora_rank=None), seed=0)
    names = {n for n, _ in no_norms.named_parameters() if ".0.self_attention." in n}
    assert not any("layernorm" in n for n in names) and any("linear_q_proj" in n for n in names)


def test_training_step_reaches_every_parameter():
    model = build_gpt_model(mla_config(), seed=0)
    tokens = torch.randint(0, 128, (2, 12))
    model(tokens, labels=tokens).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_latent_cache_equals_recompute_and_is_smaller_than_gqa():
    model = build_gpt_model(mla_config(), seed=0).eval()
    tokens = torch.randint(0, 128, (1, 10))
    cache = KVCache(16)
    with torch.no_grad():
        parts = [model(tokens[:, :7], kv_cache=cache)] + [model(tokens[:, i:i + 1], kv_cache=cache) for i in (7, 8, 9)]
        full = model(tokens)
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)
    mla_per_token = cache.nbytes() // (16 * 2)  # bytes per position and layer
    assert mla_per_token == (16 + 8) * 4
    gqa = build_gpt_model(llama_config(), seed=0).eval()  # same width: 4 heads of 16 channels, 2 kv groups
    gqa_cache = KVCache(16)
    with torch.no_grad():
        gqa(tokens, kv_cache=gqa_cache)
    assert gqa_cache.nbytes() // (16 * 2) == 2 * 2 * 16 * 4 > mla_per_token


@pytest.mark.parametrize("overrides, error, match", [
    (dict(num_query_groups=2), NotSupportedError, "num_query_groups=2"),
    (dict(rotary_interleaved=True), NotSupportedError, "rotary_interleaved=True"),
    (dict(softmax_scale=0.3), NotSupportedError, "softmax_scale=0.3"),
    (dict(window_size=[3, 0]), NotSupportedError, "window_size"),
    (dict(position_embedding_type="learned_absolute"), NotSupportedError, "position_embedding_type"),
    (dict(kv_lora_rank=0), ConfigError, "kv_lora_rank=0"),
    (dict(q_lora_rank=0), ConfigError, "q_lora_rank=0"),
    (dict(qk_pos_emb_head_dim=7), ConfigError, "qk_pos_emb_head_dim=7"),
    (dict(position_embedding_type="yarn", yarn_original_max_position_embeddings=16, yarn_rotary_scaling_factor=4.0,
          rotary_scaling_factor=40.0), ConfigError, "yarn_rotary_scaling_factor=4.0"),
    (dict(mla_latent_layernorm_epsilon=0.0), ConfigError, "mla_latent_layernorm_epsilon=0.0 must be a positive"),
    (dict(mla_latent_layernorm_epsilon=1e-6, qk_layernorm=False), ConfigError, "needs qk_layernorm=True"),
])
def test_bad_settings_fail_in_one_line(overrides, error, match):
    with pytest.raises(error, match=match) as info:
        resolve_model_args(mla_config(**overrides))
    assert "\n" not in str(info.value)


def test_latent_norms_take_their_own_epsilon_only_with_mla():
    model = build_gpt_model(mla_config(layernorm_epsilon=1e-5, mla_latent_layernorm_epsilon=1e-6), seed=0)
    layer = model.decoder.layers["0"]
    assert layer.self_attention.q_layernorm.eps == layer.self_attention.kv_layernorm.eps == 1e-6
    assert layer.input_layernorm.eps == 1e-5
    with pytest.raises(ConfigError, match="mla_latent_layernorm_epsilon=1e-06 needs multi_latent_attention=True"):
        resolve_model_args(llama_config(mla_latent_layernorm_epsilon=1e-6))


def test_mla_is_rejected_for_other_models():
    from longspan.config.rules.model import check_fixed_fields, T5_FIXED_FIELDS

    class T5Like:
        multi_latent_attention = True

    with pytest.raises(NotSupportedError, match="multi_latent_attention"):
        check_fixed_fields(T5Like(), T5_FIXED_FIELDS, "by longspan's T5 model")


def test_yarn_uses_the_mla_fields():
    args = resolve_model_args(mla_config(position_embedding_type="yarn", yarn_original_max_position_embeddings=16,
                                         rotary_scaling_factor=4.0, mscale=0.8, mscale_all_dim=0.5))
    scaling = args.rope_scaling_method
    assert (scaling.kind, scaling.factor, scaling.mscale, scaling.mscale_all_dim) == ("yarn", 4.0, 0.8, 0.5)
    assert args.mla.softmax_scale == pytest.approx((0.1 * 0.5 * math.log(4.0) + 1) ** 2 / math.sqrt(20))


def test_flops_count_the_mla_matmuls():
    """Training FLOPs (3x forward, 2 per multiply-add) of the MLA projections, latent norms and causal core,
    counted from the built module's weight shapes; the rest of the model is counted as for the same model with plain attention."""
    from longspan.config.schema.container import ConfigContainer
    from longspan.planner.flops import num_floating_point_operations

    base = llama_config()  # 4 heads of 16 channels, 2 kv groups: q width 64, k/v width 32
    s, layers = base.seq_length, base.num_layers
    plain_attention = s * 6 * layers * (64 * (64 + 2 * 32) + 64 * 64) + 6 * 64 * layers * s * s
    rest = num_floating_point_operations(ConfigContainer(model=base)) - plain_attention
    for q_lora_rank in (24, None):
        provider = mla_config(q_lora_rank=q_lora_rank)
        attn = build_gpt_model(provider, seed=0).decoder.layers["0"].self_attention
        # the projections, and the latent norms as Megatron Bridge's formula counts them (a multiply-add each)
        weights = sum(m.weight.numel() for n, m in attn.named_modules()
                      if n.startswith("linear_") or n in ("q_layernorm", "kv_layernorm"))
        core = 3 * 4 * ((12 + 8) + 10)  # per s^2: Q.K^T over 20 channels, P.V over 10, halved by causality
        got = num_floating_point_operations(ConfigContainer(model=provider))
        assert got == rest + s * 6 * layers * weights + core * layers * s * s
