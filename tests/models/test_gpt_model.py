"""GPTModel behaviour: recompute, masks, pipeline stage cuts, vocab padding, config errors, helpers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.models.gpt_test_config import llama_config, make_config

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models import transformer as transformer_mod
from longspan.models.gpt import GPTModel, apply_deterministic_mode, build_gpt_model, num_parameters


def _tokens(cfg, b=2, s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (b, s), generator=g), torch.randint(0, cfg.vocab_size, (b, s), generator=g)


def _loss_and_grads(model, tokens, labels, seed=7):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks in every run
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "granularity,method,num_layers,expected_calls",
    [
        ("full", "uniform", 1, [2, 2, 2]),
        ("full", "uniform", 2, [2, 2, 2]),
        ("full", "block", 1, [2, 1, 1]),
        ("selective", None, None, [2, 2, 2]),
    ],
)
def test_recompute_matches_no_recompute(monkeypatch, granularity, method, num_layers, expected_calls):
    base = dict(num_layers=3, hidden_dropout=0.1, attention_dropout=0.1, vocab_size=128)
    ref_model = build_gpt_model(llama_config(**base), seed=3).train()
    cfg = llama_config(**base, recompute_granularity=granularity, recompute_method=method, recompute_num_layers=num_layers)
    model = build_gpt_model(cfg, seed=3).train()
    tokens, labels = _tokens(cfg)
    ref_loss, ref_grads = _loss_and_grads(ref_model, tokens, labels)

    # Count how often each layer's forward (full) or attention core (selective) runs: recompute runs it twice.
    calls = [0, 0, 0]
    if granularity == "full":
        for i, layer in enumerate(model.decoder.layers.values()):
            layer.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    else:
        real = transformer_mod.core_attention
        order = iter(list(range(3)) + list(range(3)))  # forward 0,1,2 then recompute in backward (any order)

        def counting(*args, **kwargs):
            i = next(order)
            calls[i] += 1
            return real(*args, **kwargs)

        for layer in model.decoder.layers.values():  # the attention core is a per-module attribute
            layer.self_attention.core_attention = counting
    loss, grads = _loss_and_grads(model, tokens, labels)
    if granularity == "selective":
        assert sum(calls) == sum(expected_calls)
    else:
        assert calls == expected_calls
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_recompute_full_needs_num_layers():
    with pytest.raises(ConfigError, match="recompute_num_layers"):
        GPTModel(llama_config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=None))


def test_plain_causal_mask_equals_causal_fast_path():
    cfg = llama_config()
    model = build_gpt_model(cfg, seed=1).eval()
    tokens, labels = _tokens(cfg, s=12)
    mask = ~torch.tril(torch.ones(12, 12, dtype=torch.bool)).view(1, 1, 12, 12)  # True = masked
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, attention_mask=mask), model(tokens), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(
            model(tokens, attention_mask=mask.expand(2, 1, 12, 12), labels=labels), model(tokens, labels=labels)
        )


@pytest.mark.parametrize("position_embedding_type", ["rope", "learned_absolute"])
def test_reset_attention_mask_and_position_ids_equal_separate_documents(position_embedding_type):
    """Megatron's reset_attention_mask/reset_position_ids: two packed documents behave as two sequences."""
    cfg = llama_config(position_embedding_type=position_embedding_type, seq_length=16)
    model = build_gpt_model(cfg, seed=1).eval()
    tokens, _ = _tokens(cfg, b=1, s=12)
    split = 5
    mask = ~torch.tril(torch.ones(12, 12, dtype=torch.bool))
    mask[split:, :split] = True  # the second document does not see the first
    position_ids = torch.cat([torch.arange(split), torch.arange(12 - split)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, position_ids=position_ids, attention_mask=mask.view(1, 1, 12, 12))
        first = model(tokens[:, :split])
        second = model(tokens[:, split:])
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stage_cut_equals_full_model(tied):
    cfg = llama_config(num_layers=4, share_embeddings_and_output_weights=tied, embedding_init_method_std=0.05)
    full = build_gpt_model(cfg, seed=11).eval()
    stage0 = build_gpt_model(cfg, pre_process=True, post_process=False, seed=11, layer_numbers=[0, 1]).eval()
    stage1 = build_gpt_model(cfg, pre_process=False, post_process=True, seed=11, layer_numbers=[2, 3]).eval()
    assert stage0.output_layer is None and stage0.decoder.final_layernorm is None
    assert stage1.embedding is None and list(stage1.decoder.layers.keys()) == ["2", "3"]
    names = set(dict(stage0.named_parameters())) | set(dict(stage1.named_parameters()))
    full_params = dict(full.named_parameters())
    if tied:  # the last stage holds its own copy of the tied weight, initialized like the embedding
        names.discard("output_layer.weight")
        assert torch.equal(stage1.output_layer.weight, full.embedding.word_embeddings.weight)
    assert names == set(full_params)
    tokens, labels = _tokens(cfg)
    with torch.no_grad():
        hidden = stage0(tokens)
        assert hidden.shape == (2, 16, cfg.hidden_size)
        torch.testing.assert_close(stage1(hidden), full(tokens), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(stage1(hidden_states=hidden, labels=labels), full(tokens, labels=labels))


def test_deleting_layers_from_full_build_keeps_names_and_runs():
    cfg = llama_config(num_layers=4)
    model = build_gpt_model(cfg, seed=2, post_process=False)
    del model.decoder.layers["2"], model.decoder.layers["3"]
    stage0 = build_gpt_model(cfg, seed=2, post_process=False, layer_numbers=[0, 1])
    tokens, _ = _tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), stage0(tokens))


@pytest.mark.parametrize("vocab,divisible,padded", [(100, 128, 128), (130, 64, 192), (256, 128, 256)])
def test_padded_vocab_shapes(vocab, divisible, padded):
    cfg = make_config(vocab_size=vocab, make_vocab_size_divisible_by=divisible, share_embeddings_and_output_weights=False)
    model = build_gpt_model(cfg, seed=0).eval()
    assert model.embedding.word_embeddings.weight.shape == (padded, cfg.hidden_size)
    assert model.output_layer.weight.shape == (padded, cfg.hidden_size)
    tokens = torch.randint(0, vocab, (2, 8))
    with torch.no_grad():
        assert model(tokens).shape == (2, 8, padded)
        loss = model(tokens, labels=tokens)
    assert loss.shape == (2, 8) and loss.dtype == torch.float32


def test_loss_is_fp32_cross_entropy_of_bf16_logits():
    cfg = llama_config(params_dtype=torch.bfloat16)
    model = build_gpt_model(cfg, seed=0).eval()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    tokens, labels = _tokens(cfg)
    with torch.no_grad():
        logits = model(tokens)
        loss = model(tokens, labels=labels)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    expected = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, expected.view(labels.shape))


def test_partial_rotary_and_llama3_scaling_match_megatron_core():
    """RoPE against megatron-core's RotaryEmbedding frequencies and its rotate-half application."""
    import megatron.core.models.common.embeddings.rope_utils as rope_utils  # the oracle: CI installs it
    import megatron.core.models.common.embeddings.rotary_pos_embedding as mrope
    from longspan.models.rope import RotaryEmbedding, apply_rotary

    for percent, scaling in ((0.5, False), (0.25, True), (1.0, True)):
        ours = RotaryEmbedding(32, rotary_percent=percent, rotary_base=500000, rope_scaling=scaling)
        ref = mrope.RotaryEmbedding(32, percent, rotary_base=500000, rope_scaling=scaling, use_cpu_initialization=True)
        torch.testing.assert_close(ours.inv_freq(torch.device("cpu")), ref.inv_freq, rtol=0, atol=0)
        x = torch.randn(2, 10, 4, 32)  # [b, s, heads, d]
        positions = torch.arange(3000, 3010)
        cos, sin = ours(positions.unsqueeze(0).expand(2, -1))
        freqs = torch.outer(positions.float(), ref.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # Megatron: [s, 1, 1, rot]
        expected = rope_utils._apply_rotary_pos_emb_bshd(x.transpose(0, 1), emb, rotary_interleaved=False)
        torch.testing.assert_close(apply_rotary(x, cos, sin), expected.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_attention_reads_local_heads_from_projection_shapes():
    """Halving q/k/v (as column-parallel TP does) and proj rows keeps the maths of those heads."""
    cfg = llama_config(num_attention_heads=4, num_query_groups=2, hidden_dropout=0.0)
    attn = build_gpt_model(cfg, seed=1).decoder.layers["0"].self_attention.eval()
    x = torch.randn(2, 8, cfg.hidden_size)
    d = cfg.hidden_size // 4
    with torch.no_grad():
        full = attn(x)
        halves = []
        for r in range(2):
            part = transformer_mod.SelfAttention.__new__(transformer_mod.SelfAttention)
            torch.nn.Module.__init__(part)
            part.head_dim, part.attention_dropout, part.softmax_scale = d, 0.0, None
            part.q_layernorm = part.k_layernorm = part.linear_gate = None
            part.recompute_core_attention = False
            part.core_attention = transformer_mod.core_attention
            part.linear_q = torch.nn.Linear(cfg.hidden_size, 2 * d, bias=False)
            part.linear_k = torch.nn.Linear(cfg.hidden_size, d, bias=False)
            part.linear_v = torch.nn.Linear(cfg.hidden_size, d, bias=False)
            part.linear_proj = torch.nn.Linear(2 * d, cfg.hidden_size, bias=False)
            part.linear_q.weight.copy_(attn.linear_q.weight[r * 2 * d:(r + 1) * 2 * d])
            part.linear_k.weight.copy_(attn.linear_k.weight[r * d:(r + 1) * d])
            part.linear_v.weight.copy_(attn.linear_v.weight[r * d:(r + 1) * d])
            part.linear_proj.weight.copy_(attn.linear_proj.weight[:, r * 2 * d:(r + 1) * 2 * d])
            halves.append(part(x))
    torch.testing.assert_close(halves[0] + halves[1], full, atol=1e-6, rtol=1e-5)


def test_dropout_modules_active_only_in_training():
    cfg = llama_config(hidden_dropout=0.5, attention_dropout=0.5)
    model = build_gpt_model(cfg, seed=0)
    layer = model.decoder.layers["0"]
    assert isinstance(layer.self_attn_dropout, torch.nn.Dropout) and layer.self_attn_dropout.p == 0.5
    assert model.embedding.embedding_dropout.p == 0.5
    tokens, _ = _tokens(cfg)
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(tokens), model(tokens))
        model.train()
        assert not torch.allclose(model(tokens), model(tokens))


@pytest.mark.parametrize(
    "field,value",
    [
        ("normalization", "ScaleNorm"),
        ("position_embedding_type", "alibi"),
        ("recompute_granularity", "everything"),
        ("multi_latent_attention", True),
        ("window_size", [128, 2]),  # a causal LM attends to no later token
    ],
)
def test_unsupported_values_raise_one_line(field, value):
    cfg = llama_config()
    assert hasattr(cfg, field), f"the provider lost its {field} field"
    setattr(cfg, field, value)
    with pytest.raises(NotSupportedError) as info:
        build_gpt_model(cfg)
    assert field in str(info.value) and "\n" not in str(info.value)


def test_bad_head_counts_raise_config_error():
    with pytest.raises(ConfigError, match="num_query_groups"):
        build_gpt_model(llama_config(num_attention_heads=4, num_query_groups=3))


def test_num_parameters_formula():
    h, f, v, s, L = 64, 256, 128, 32, 2
    cfg = make_config(num_layers=L, hidden_size=h, ffn_hidden_size=f, vocab_size=v, seq_length=s,
                      share_embeddings_and_output_weights=True)
    model = build_gpt_model(cfg, seed=0)
    per_layer = (4 * h * h + 4 * h) + (2 * h * f + f + h) + 2 * (2 * h)  # attn, mlp, two LayerNorms
    embeddings = v * h + s * h
    expected = embeddings + L * per_layer + 2 * h  # + final LayerNorm; tied output adds nothing
    assert num_parameters(model) == expected
    assert num_parameters(model, exclude_embeddings=True) == expected - embeddings
    untied = build_gpt_model(make_config(num_layers=L, hidden_size=h, ffn_hidden_size=f, vocab_size=v, seq_length=s,
                                         share_embeddings_and_output_weights=False), seed=0)
    assert num_parameters(untied) == expected + v * h
    assert num_parameters(untied, exclude_embeddings=True) == expected - embeddings + v * h


def test_apply_deterministic_mode():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        apply_deterministic_mode(llama_config(deterministic_mode=False))
        assert torch.are_deterministic_algorithms_enabled() == before
        apply_deterministic_mode(llama_config(deterministic_mode=True))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_meta_build_and_scaled_attention_shapes():
    cfg = llama_config(kv_channels=24, num_attention_heads=4, num_query_groups=1, qk_layernorm=True)
    model = build_gpt_model(cfg, materialize=False)
    assert all(p.is_meta for p in model.parameters())
    attn = model.decoder.layers["0"].self_attention
    assert attn.linear_q.weight.shape == (4 * 24, cfg.hidden_size)
    assert attn.linear_k.weight.shape == (24, cfg.hidden_size)
    assert attn.q_layernorm.weight.shape == (24,)
    assert model.decoder.layers["0"].mlp.linear_fc1_gate.weight.shape == (cfg.ffn_hidden_size, cfg.hidden_size)
    assert math.isclose(attn.linear_proj.init_std, cfg.init_method_std / math.sqrt(2 * cfg.num_layers))


def test_provider_provide_builds_gpt_model():
    import longspan.models.gpt_provider as provider_mod
    provider = provider_mod.GPTModelProvider(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100,
                                             seq_length=16)
    torch.manual_seed(21)
    model = provider.provide()
    assert isinstance(model, GPTModel) and not any(p.is_meta for p in model.parameters())
    expected = build_gpt_model(provider, seed=21)  # provide() draws from torch.initial_seed()
    assert all(torch.equal(p, dict(expected.named_parameters())[n]) for n, p in model.named_parameters())
    stage = provider.provide(pre_process=False, post_process=True)
    assert stage.embedding is None and stage.output_layer is not None


def test_seq_len_interpolation_factor_divides_positions():
    from longspan.models.rope import RotaryEmbedding

    plain = RotaryEmbedding(16, rotary_base=10000)
    interpolated = RotaryEmbedding(16, rotary_base=10000, seq_len_interpolation_factor=2.0)
    positions = torch.arange(0, 20, 2).unsqueeze(0)
    for a, b in zip(interpolated(positions), plain(positions // 2)):
        torch.testing.assert_close(a, b)


def test_softmax_scale_is_honoured():
    """softmax_scale = c/sqrt(d) equals the default scale with the query projection multiplied by c."""
    cfg = llama_config(hidden_dropout=0.0, attention_dropout=0.0)
    d = cfg.hidden_size // cfg.num_attention_heads
    scaled = build_gpt_model(llama_config(softmax_scale=0.3 / math.sqrt(d)), seed=5).eval()
    reference = build_gpt_model(cfg, seed=5).eval()
    with torch.no_grad():
        for layer in reference.decoder.layers.values():
            layer.self_attention.linear_q.weight.mul_(0.3)
        tokens, _ = _tokens(cfg)
        torch.testing.assert_close(scaled(tokens), reference(tokens), atol=1e-5, rtol=1e-5)


def test_fp16_lm_cross_entropy_computes_the_loss_in_fp16():
    """Megatron's fp16_lm_cross_entropy: the unreduced loss is computed on fp16 logits (returned as float32)."""
    cfg = llama_config(params_dtype=torch.bfloat16, fp16_lm_cross_entropy=True)
    model = build_gpt_model(cfg, seed=0).eval()
    tokens, labels = _tokens(cfg)
    with torch.no_grad():
        logits = model(tokens)
        loss = model(tokens, labels=labels)
    flat, targets = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    expected = F.cross_entropy(flat.half(), targets, reduction="none").float()
    in_fp32 = F.cross_entropy(flat.float(), targets, reduction="none")
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected.view(labels.shape), rtol=0, atol=0)
    assert not torch.equal(loss, in_fp32.view(labels.shape))  # the precision is really lower


def test_integer_mask_means_the_same_as_bool_mask():
    cfg = llama_config()
    model = build_gpt_model(cfg, seed=1).eval()
    tokens, _ = _tokens(cfg, s=10)
    mask = ~torch.tril(torch.ones(10, 10, dtype=torch.bool)).view(1, 1, 10, 10)
    mask[..., 6:, :3] = True
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, attention_mask=mask.long()), model(tokens, attention_mask=mask))
