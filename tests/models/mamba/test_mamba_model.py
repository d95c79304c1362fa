"""MambaModel: layer allocation (megatron-core as oracle), names, init, chunk invariance, generation state."""

from __future__ import annotations

import pytest
import torch
from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers as megatron_allocate_layers
from megatron.core.transformer.utils import is_layer_window_attention

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.mamba import GatedRMSNorm, MambaModel, allocate_layers, build_mamba_model
from longspan.models.transformer import KVCache
from tests.models.mamba.mamba_test_config import hybrid_config, mamba_config


@pytest.mark.parametrize("layers,attention,mlp", [(10, 0.3, 0.2), (8, 0.25, 0.0), (7, 0.0, 0.3), (12, 0.5, 0.5),
                                                  (4, 0.0, 0.0)])
def test_layer_allocation_matches_megatron(layers: int, attention: float, mlp: float) -> None:
    assert allocate_layers(layers, attention, mlp, None) == megatron_allocate_layers(layers, attention, mlp)


def test_pattern_builds_the_named_layers() -> None:
    model = build_mamba_model(hybrid_config(), seed=1)
    names = {n for n, _ in model.named_parameters()}
    for expected in ["decoder.layers.0.mixer.in_proj.z.weight", "decoder.layers.0.mixer.in_proj.dt.weight",
                     "decoder.layers.0.mixer.conv1d.x.weight", "decoder.layers.0.mixer.conv1d.C.bias",
                     "decoder.layers.0.mixer.A_log", "decoder.layers.0.mixer.D",
                     "decoder.layers.0.mixer.dt_bias", "decoder.layers.0.mixer.norm.weight",
                     "decoder.layers.0.mixer.out_proj.weight", "decoder.layers.0.norm.weight",
                     "decoder.layers.1.self_attention.linear_q.weight", "decoder.layers.1.input_layernorm.weight",
                     "decoder.layers.2.mlp.linear_fc1.weight", "decoder.layers.2.pre_mlp_layernorm.weight",
                     "decoder.layers.3.mixer.in_proj.x.weight", "decoder.final_norm.weight", "output_layer.weight"]:
        assert expected in names
    assert not any(n.startswith("decoder.layers.1.mlp") or n.startswith("decoder.layers.2.self_attention")
                   for n in names)
    cfg = mamba_config()
    d_inner, heads, groups, state = 64, 8, 2, 8
    mixer = model.decoder.layers["0"].mixer
    rows = {"z": d_inner, "x": d_inner, "B": groups * state, "C": groups * state, "dt": heads}
    assert {k: tuple(m.weight.shape) for k, m in mixer.in_proj.items()} == {
        k: (n, cfg.hidden_size) for k, n in rows.items()}
    assert {k: tuple(m.weight.shape) for k, m in mixer.conv1d.items()} == {k: (rows[k], 1, 4) for k in "xBC"}


def test_init_follows_megatron_ranges_and_is_layout_independent() -> None:
    full = build_mamba_model(hybrid_config(), seed=3)
    mixer = full.decoder.layers["0"].mixer
    A = torch.exp(mixer.A_log)
    assert ((A >= 1.0) & (A <= 16.0)).all()
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert ((dt >= 1e-3 - 1e-7) & (dt <= 0.1 + 1e-7)).all()
    assert torch.equal(mixer.D, torch.ones_like(mixer.D))
    bound = 1.0 / 2.0  # 1/sqrt(conv kernel 4)
    conv = torch.cat([mixer.conv1d[k].weight for k in "xBC"])
    assert conv.abs().max() <= bound and conv.std() > bound / 4
    stage = build_mamba_model(hybrid_config(), pre_process=False, post_process=True, seed=3, layer_numbers=[2, 3])
    full_params = dict(full.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, full_params[name]), name


def test_chunk_size_does_not_change_the_model() -> None:
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(0))
    outs = []
    for chunk in (1, 4, 8, 32):
        model = build_mamba_model(hybrid_config(mamba_chunk_size=chunk), seed=5)
        outs.append(model(ids))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("make", [mamba_config, hybrid_config, pytest.param(
    lambda: hybrid_config(window_size=[2, 0]), id="windowed_hybrid")])  # its attention's cache keeps the window
def test_recurrent_generation_equals_the_full_forward(make) -> None:
    model = build_mamba_model(make(), seed=7).eval()
    ids = torch.randint(0, 128, (2, 15), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(32)
        pieces = [model(ids[:, :6], kv_cache=cache), model(ids[:, 6:9], kv_cache=cache)]
        pieces += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(9, 15)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-5)
    assert cache.seq_len == 15


def test_per_token_loss_contract() -> None:
    model = build_mamba_model(mamba_config(), seed=2)
    ids = torch.randint(0, 128, (2, 9))
    labels = torch.randint(0, 128, (2, 9))
    loss = model(ids, labels=labels)
    assert loss.shape == (2, 9) and loss.dtype == torch.float32
    logits = model(ids)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 9)
    torch.testing.assert_close(loss, want)


def test_gated_norm_normalizes_per_group() -> None:
    norm = GatedRMSNorm(8, 4, 1e-5, torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(8.0))
    y, z = torch.randn(3, 8), torch.randn(3, 8)
    g = (y * torch.nn.functional.silu(z)).view(3, 2, 4)
    want = (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5)).view(3, 8) * torch.arange(8.0)
    torch.testing.assert_close(norm(y, z), want)


def test_mamba_num_heads_sets_d_inner() -> None:
    model = build_mamba_model(mamba_config(mamba_num_heads=4, mamba_num_groups=4), seed=0)
    assert model.decoder.layers["0"].mixer.d_inner == 32


@pytest.mark.parametrize("overrides,match", [
    (dict(hybrid_override_pattern="M*"), "has 2 layers but model.num_layers=4"),
    (dict(hybrid_override_pattern="MX*M"), "use M \\(Mamba\\)"),
    (dict(hybrid_override_pattern="ME*M"), "num_moe_experts"),
    (dict(mamba_num_groups=3), "mamba_num_groups=3"),
    (dict(mamba_chunk_size=0), "mamba_chunk_size=0"),
    (dict(hybrid_override_pattern=None, hybrid_attention_ratio=0.8, hybrid_mlp_ratio=0.5), "sum to at most 1"),
])
def test_bad_fields_are_config_errors(overrides, match) -> None:
    with pytest.raises(ConfigError, match=match):
        MambaModel(hybrid_config(**overrides))


@pytest.mark.parametrize("overrides,match", [
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), "recompute_granularity"),
    (dict(mtp_num_layers=1), r"mtp_num_layers=1 is not supported yet for MambaProvider models \(multi-token"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
])
def test_unsupported_fields_raise_one_line(overrides, match) -> None:
    with pytest.raises(NotSupportedError, match=match):
        MambaModel(mamba_config(**overrides))


def test_moe_layers_from_the_pattern() -> None:
    cfg = hybrid_config(hybrid_override_pattern="ME*M", num_moe_experts=4, moe_router_topk=2,
                        moe_ffn_hidden_size=16)
    model = build_mamba_model(cfg, seed=0)
    assert getattr(model.decoder.layers["1"].mlp, "is_moe", False)
    assert model(torch.randint(0, 128, (1, 5))).shape == (1, 5, 128)


def test_fp16_lm_cross_entropy_computes_the_loss_in_half_precision() -> None:
    ids, labels = torch.randint(0, 128, (2, 9)), torch.randint(0, 128, (2, 9))
    plain = build_mamba_model(mamba_config(), seed=2)(ids, labels=labels)
    model = build_mamba_model(mamba_config(fp16_lm_cross_entropy=True), seed=2)
    half = model(ids, labels=labels)
    want = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1).half(), labels.flatten(), reduction="none")
    assert torch.equal(half.flatten(), want.float()) and not torch.equal(half, plain)


def test_tied_embeddings_use_the_word_embeddings() -> None:
    model = build_mamba_model(hybrid_config(share_embeddings_and_output_weights=True), seed=3)
    assert model.output_layer is None
    ids = torch.randint(0, 128, (1, 7))
    hidden = model.decoder(model.embedding(ids, None), None, None)
    torch.testing.assert_close(model(ids), hidden @ model.embedding.word_embeddings.weight.T)


def test_zero_centered_gamma_stores_gamma_minus_one_in_the_block_norms() -> None:
    """Megatron's MambaLayer / final / hybrid norms honour it (its mixer's gated norm does not): same maths."""
    plain = build_mamba_model(hybrid_config(), seed=5)
    centred = build_mamba_model(hybrid_config(layernorm_zero_centered_gamma=True), seed=5)
    norms = [n for n, _ in centred.named_parameters() if n.endswith("norm.weight") and ".mixer." not in n]
    assert len(norms) == 5  # M, *, -, M layers' norms and the final norm
    params = dict(centred.named_parameters())
    assert all(torch.equal(params[n], torch.zeros_like(params[n])) for n in norms)
    assert torch.equal(params["decoder.layers.0.mixer.norm.weight"], torch.ones(64))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(centred(ids), plain(ids), rtol=1e-6, atol=1e-6)


def test_fp32_residual_connection_keeps_the_residual_stream_in_float32() -> None:
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    seen = {}
    for fp32 in (False, True):
        model = build_mamba_model(hybrid_config(params_dtype=torch.bfloat16, fp32_residual_connection=fp32), seed=5)
        dtypes = []
        for layer in model.decoder.layers.values():
            layer.register_forward_hook(lambda _m, _a, out, d=dtypes: d.append(out.dtype))
        seen[fp32] = (dtypes, model(ids, labels=ids).float())
    assert seen[False][0] == [torch.bfloat16] * 4 and seen[True][0] == [torch.float32] * 4
    assert not torch.equal(seen[False][1], seen[True][1])  # the sums are rounded differently


def _band_mask(length: int, left: int) -> torch.Tensor:
    """Hand-built sliding-window mask (True = masked): query i sees keys j with i - left <= j <= i."""
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return ((j > i) | (j < i - left))[None, None]


def test_sliding_window_reaches_the_hybrid_attention_layers_by_their_index_in_the_whole_stack() -> None:
    """Megatron numbers every layer of a MambaStack (Mamba ones too) and windows an attention layer by that
    number: in ``*M*M`` with skip frequency 2 both attention layers (numbers 1 and 3) are windowed, where
    counting attention layers alone would make the second one full attention."""
    window, skip, pattern = [2, 0], 2, "*M*M"
    model = build_mamba_model(hybrid_config(hybrid_override_pattern=pattern, window_size=window,
                                            window_attn_skip_freq=skip), seed=4)
    plain = build_mamba_model(hybrid_config(hybrid_override_pattern=pattern), seed=4)
    windows = [getattr(getattr(layer, "self_attention", None), "window", None) for layer in model.decoder.layers.values()]
    want = [window[0] + 1 if kind == "*" and is_layer_window_attention(window, skip, i + 1) else None
            for i, kind in enumerate(pattern)]
    assert windows == want == [3, None, 3, None]
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    assert not torch.allclose(logits, plain(ids), atol=1e-4)  # the window changes what the layers see
    # the same weights without the window, every attention layer given the hand-built band: the same logits
    torch.testing.assert_close(logits, plain(ids, attention_mask=_band_mask(11, window[0])), rtol=1e-5, atol=1e-6)


def test_residual_post_layernorm_changes_the_hybrid_attention_and_mlp_layers_only() -> None:
    """Megatron's semantics: its MambaLayer always adds to its input; the hybrid attention / MLP layers
    (TransformerLayers) add to their norm's output with apply_residual_connection_post_layernorm."""
    model = build_mamba_model(hybrid_config(apply_residual_connection_post_layernorm=True), seed=6)
    plain = build_mamba_model(hybrid_config(), seed=6)
    h = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1))
    layers = model.decoder.layers
    torch.testing.assert_close(layers["0"](h), plain.decoder.layers["0"](h), rtol=0, atol=0)  # Mamba: unchanged
    torch.testing.assert_close(layers["3"](h), h + layers["3"].mixer(layers["3"].norm(h)), rtol=0, atol=0)
    attention = layers["1"]
    normed = attention.input_layernorm(h)
    torch.testing.assert_close(attention(h), normed + attention.self_attention(normed, None, None), rtol=0, atol=0)
    mlp = layers["2"]
    normed = mlp.pre_mlp_layernorm(h)
    torch.testing.assert_close(mlp(h), normed + mlp.mlp(normed), rtol=0, atol=0)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(model(ids), plain(ids), atol=1e-4)
