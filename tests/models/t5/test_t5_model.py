"""T5Model: shapes, masks, causality, per-parameter initialization and one-line errors for unsupported fields."""

from __future__ import annotations

import pytest
import torch

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models import T5ModelProvider
from longspan.models.builder import build_meta_model
from longspan.models.init import init_weights
from longspan.models.t5 import T5Model, relative_position_bucket


def tiny_t5(**kw) -> T5ModelProvider:
    fields = dict(num_layers=2, encoder_num_layers=3, hidden_size=32, num_attention_heads=4, kv_channels=6,
                  ffn_hidden_size=48, vocab_size=90, make_vocab_size_divisible_by=16, seq_length=16, seq_length_dec=8,
                  max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(kw)
    provider = T5ModelProvider(**fields)
    provider.finalize()
    return provider


@pytest.mark.parametrize("positions", ["learned_absolute", "relative", "rope"])
def test_forward_shapes_loss_and_tied_head(positions):
    model = tiny_t5(position_embedding_type=positions).provide()
    assert isinstance(model, T5Model) and model.output_layer is None  # tied by default
    assert (model.encoder_relative_pos_emb is not None) == (positions == "relative")
    assert (model.embedding.position_embeddings is not None) == (positions == "learned_absolute")
    assert len(model.encoder.layers) == 3 and len(model.decoder.layers) == 2
    enc = torch.randint(0, 90, (2, 16))
    dec = torch.randint(0, 90, (2, 8))
    logits = model(enc, dec)
    assert logits.shape == (2, 8, 96)
    labels = torch.randint(0, 90, (2, 8))
    loss = model(enc, dec, lm_labels=labels)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 8)
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-6)
    untied = tiny_t5(position_embedding_type=positions, share_embeddings_and_output_weights=False).provide()
    assert untied.output_layer is not None and untied.output_layer.weight.shape == (96, 32)


@pytest.mark.parametrize("positions", ["learned_absolute", "relative", "rope"])
def test_decoder_is_causal_and_masked_encoder_positions_are_ignored(positions):
    model = tiny_t5(position_embedding_type=positions).provide().eval()
    enc = torch.randint(0, 90, (2, 16))
    dec = torch.randint(0, 90, (2, 8))
    pad = torch.zeros(2, 16, dtype=torch.bool)
    pad[0, 10:] = True
    pad[1, 13:] = True
    masks = dict(encoder_attn_mask=pad[:, None, None, :], encoder_decoder_attn_mask=pad[:, None, None, :])
    base = model(enc, dec, **masks)
    later = dec.clone()
    later[:, 5:] = (later[:, 5:] + 1) % 90
    torch.testing.assert_close(model(enc, later, **masks)[:, :5], base[:, :5], rtol=0, atol=0)
    assert not torch.allclose(model(enc, later, **masks)[:, 5:], base[:, 5:])
    other = enc.clone()
    other[pad] = (other[pad] + 7) % 90  # only masked (padding) tokens change
    torch.testing.assert_close(model(other, dec, **masks), base, rtol=0, atol=1e-6)
    assert not torch.allclose(model(other, dec), model(enc, dec))  # without the masks they are seen


def test_relative_buckets_follow_t5():
    rel = torch.arange(-200, 201)
    both = relative_position_bucket(rel, True, 32, 128)
    causal = relative_position_bucket(rel, False, 32, 128)
    assert both[200] == 0 and both[201] == 17 and both[199] == 1  # 0, +1 (after), -1 (before)
    assert both.max() == 31 and both[:60].unique().tolist() == [15]  # far past saturates
    assert (causal[201:] == 0).all() and causal[199] == 1 and causal.max() == 31


def test_init_is_per_parameter_and_reproducible():
    provider = tiny_t5(position_embedding_type="relative", share_embeddings_and_output_weights=False)
    a = init_weights(build_meta_model(provider), seed=7)
    b = init_weights(build_meta_model(provider), seed=7)
    c = init_weights(build_meta_model(provider), seed=8)
    for (name, x), (_, y), (_, z) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(x, y), name
        if x.dim() > 1:
            assert not torch.equal(x, z), name
    std = a.encoder.layers["0"].self_attention.linear_proj.init_std
    assert std == pytest.approx(0.02 / (2 * 3) ** 0.5)  # output projections scale with their stack's depth
    assert a.decoder.layers["0"].mlp.linear_fc2.init_std == pytest.approx(0.02 / (2 * 2) ** 0.5)


@pytest.mark.parametrize(
    "field, value, error, text",
    [
        ("position_embedding_type", "yarn", NotSupportedError, "position_embedding_type='yarn'"),
        ("num_query_groups", 2, NotSupportedError, "num_query_groups=2"),
        ("num_moe_experts", 4, NotSupportedError, "num_moe_experts=4"),
        ("encoder_pipeline_model_parallel_size", 1, ConfigError, "encoder_pipeline_model_parallel_size=1 needs"),
        ("max_position_embeddings", 8, ConfigError, "max_position_embeddings=8"),
        ("relative_attention_num_buckets", 1, ConfigError, "relative_attention_num_buckets=1"),
    ],
)
def test_unsupported_values_are_one_line_errors(field, value, error, text):
    provider = tiny_t5(**{field: value})
    with pytest.raises(error, match=text.replace("(", r"\(")) as info:
        build_meta_model(provider)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("split", ["shared_stage", "encoder_stage"])
def test_pipeline_stages_chained_equal_the_whole_model(split):
    """Stages exchange [encoder | decoder] hidden states; chained, they compute the whole model's loss.
    'shared_stage': encoder layers 0-1 on stage 0, encoder layer 2 and the decoder on stage 1 (the encoder's
    final norm and its relative table there too); 'encoder_stage': encoder_pipeline_model_parallel_size=1."""
    from longspan.core.pipeline_split import layer_counts_for_config, stage_layer_numbers
    from longspan.models.t5 import build_t5_model

    fields = dict(share_embeddings_and_output_weights=False, position_embedding_type="relative",
                  pipeline_model_parallel_size=2)
    if split == "shared_stage":
        fields["num_layers_in_first_pipeline_stage"] = 2
    else:
        fields["encoder_pipeline_model_parallel_size"] = 1
    provider = tiny_t5(**fields)
    numbers = stage_layer_numbers(layer_counts_for_config(provider))
    assert numbers == ([[0, 1], [2, 3, 4]] if split == "shared_stage" else [[0, 1, 2], [3, 4]])
    whole = build_t5_model(provider, seed=5)
    first, last = (build_t5_model(provider, seed=5, pre_process=i == 0, post_process=i == 1, layer_numbers=n)
                   for i, n in enumerate(numbers))
    assert first.output_layer is None and last.embedding is None
    assert (last.encoder.final_layernorm is not None) == (split == "shared_stage")
    gen = torch.Generator().manual_seed(1)
    enc, dec = torch.randint(0, 90, (2, 16), generator=gen), torch.randint(0, 90, (2, 8), generator=gen)
    pad = torch.zeros(2, 1, 1, 16, dtype=torch.bool)
    pad[1, ..., 11:] = True
    kw = dict(encoder_attn_mask=pad, encoder_decoder_attn_mask=pad, lm_labels=torch.randint(0, 90, (2, 8), generator=gen))
    hidden = first(enc, dec, **kw)
    assert hidden.shape == (2, 16 + 8, 32)
    torch.testing.assert_close(last(hidden, dec, **kw), whole(enc, dec, **kw), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fields, text", [
    (dict(share_embeddings_and_output_weights=True), "share_embeddings_and_output_weights=True with pipeline"),
    (dict(share_embeddings_and_output_weights=False, num_layers=2), r"encoder_num_layers=3 \+ model.num_layers=2"),
    (dict(share_embeddings_and_output_weights=False, context_parallel_size=2),
     "context_parallel_size=2 with pipeline_model_parallel_size=2 is not supported yet"),
    (dict(share_embeddings_and_output_weights=False, encoder_pipeline_model_parallel_size=2),
     "encoder_pipeline_model_parallel_size=2 must be 0 or less than"),
    (dict(share_embeddings_and_output_weights=False, encoder_pipeline_model_parallel_size=1,
          num_layers_in_first_pipeline_stage=3), "cannot be combined with"),
])
def test_pipeline_settings_t5_cannot_take_are_one_line_errors(fields, text):
    from longspan.core.pipeline_split import layer_counts_for_config

    with pytest.raises((ConfigError, NotSupportedError), match=text) as info:
        provider = tiny_t5(**{"pipeline_model_parallel_size": 2, "num_layers": 3, **fields})
        layer_counts_for_config(provider)
        build_meta_model(provider, pre_process=False, layer_numbers=[0])
    assert "\n" not in str(info.value)


def test_softmax_scale_and_decoder_output_scaling_change_the_logits():
    enc, dec = torch.randint(0, 90, (1, 16)), torch.randint(0, 90, (1, 8))
    torch.manual_seed(0)
    base = tiny_t5().provide()(enc, dec)
    torch.manual_seed(0)
    scaled = tiny_t5(scale_decoder_outputs=True).provide()(enc, dec)
    torch.manual_seed(0)
    unscaled_attn = tiny_t5(softmax_scale=1.0).provide()(enc, dec)
    assert not torch.allclose(base, unscaled_attn)
    torch.testing.assert_close(scaled, base * 32**-0.5, rtol=1e-6, atol=1e-6)  # linear, bias-free head


@pytest.mark.parametrize("field, value", [("multi_latent_attention", True)])
def test_validate_rejects_gpt_only_fields_for_t5(field, value):
    """The model table's GPT features that T5 lacks are 'not supported yet' for T5ModelProvider only."""
    from longspan.config.support import NOT_SUPPORTED, SUPPORTED, field_status
    from longspan.recipes import get_recipe

    assert field_status("model", field, "T5ModelProvider") == NOT_SUPPORTED
    assert field_status("model", field, "GPTModelProvider") == SUPPORTED
    cfg = get_recipe("tiny-t5")
    setattr(cfg.model, field, value)
    with pytest.raises(NotSupportedError, match=f"model.{field}={value!r} is not supported yet"):
        cfg.validate(world_size=2)


def test_fully_masked_rows_stay_finite_like_t5():
    """Masks are merged before they become a bias: a row masked by both the causal and the padding mask is
    uniform (finite), never NaN."""
    model = tiny_t5(position_embedding_type="relative").provide().eval()
    enc, dec = torch.randint(0, 90, (2, 16)), torch.randint(0, 90, (2, 8))
    everything = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    out = model(enc, dec, decoder_attn_mask=everything,
                encoder_attn_mask=torch.ones(2, 1, 1, 16, dtype=torch.bool))
    assert torch.isfinite(out).all()


def test_text_generation_refuses_t5_in_one_line():
    from longspan.inference.text_generation import _single_model

    with pytest.raises(NotSupportedError, match="encoder-decoder models \\(T5Model\\)"):
        _single_model([tiny_t5().provide()])


def _logits(provider, enc, dec, **masks):
    from longspan.models.t5 import build_t5_model

    return build_t5_model(provider, seed=2)(enc, dec, **masks)


def test_model_feature_fields_change_the_t5_model():
    """qk_layernorm adds per-head query/key norms (self- and cross-attention); the post-norm residual starts
    each branch from the norm's output; zero-centred norms store gamma - 1 (zeros at init, the same maths);
    attention_softmax_in_fp32=False keeps bf16 scores and probabilities in bf16."""
    gen = torch.Generator().manual_seed(3)
    enc, dec = torch.randint(0, 90, (2, 16), generator=gen), torch.randint(0, 90, (2, 8), generator=gen)
    base = _logits(tiny_t5(), enc, dec)
    qk = tiny_t5(qk_layernorm=True)
    model = qk.provide()
    assert model.decoder.layers["0"].cross_attention.q_layernorm.weight.shape == (6,)  # kv_channels
    assert not torch.allclose(_logits(qk, enc, dec), base)
    assert not torch.allclose(_logits(tiny_t5(apply_residual_connection_post_layernorm=True), enc, dec), base)
    centred = tiny_t5(layernorm_zero_centered_gamma=True, normalization="RMSNorm")
    assert torch.count_nonzero(centred.provide().encoder.final_layernorm.weight) == 0
    torch.testing.assert_close(_logits(centred, enc, dec), _logits(tiny_t5(normalization="RMSNorm"), enc, dec))
    bf16 = dict(params_dtype=torch.bfloat16, bf16=True)
    high = _logits(tiny_t5(**bf16), enc, dec)
    low = _logits(tiny_t5(attention_softmax_in_fp32=False, **bf16), enc, dec)
    assert high.dtype == low.dtype == torch.bfloat16 and not torch.equal(high, low)
    torch.testing.assert_close(low.float(), high.float(), rtol=0.1, atol=0.1)


def test_rotary_positions_and_their_fields_change_the_t5_model():
    """position_embedding_type='rope' rotates queries and keys of every self-attention (not cross-attention);
    rotary_percent, rotary_interleaved and seq_len_interpolation_factor each change the rotation."""
    gen = torch.Generator().manual_seed(4)
    enc, dec = torch.randint(0, 90, (2, 16), generator=gen), torch.randint(0, 90, (2, 8), generator=gen)
    rope = tiny_t5(position_embedding_type="rope")
    model = rope.provide()
    assert model.rotary_pos_emb is not None and model.embedding.position_embeddings is None
    base = _logits(rope, enc, dec)
    for field, value in (("rotary_percent", 2 / 3), ("rotary_interleaved", True), ("seq_len_interpolation_factor", 4.0)):
        changed = _logits(tiny_t5(position_embedding_type="rope", **{field: value}), enc, dec)
        assert not torch.allclose(changed, base), field
    with pytest.raises(ConfigError, match="rotary_percent=0.5 gives 3 rotary channels"):
        build_meta_model(tiny_t5(position_embedding_type="rope", rotary_percent=0.5))


@pytest.mark.parametrize("positions,window", [("learned_absolute", None), ("relative", None), ("rope", None),
                                              ("relative", [3, 2])])
def test_sequence_slices_give_the_whole_sequence_losses(positions, window):
    """What context parallel relies on, in one process: the tokens given in another order with their global
    positions (``SequenceSlice``), keys and values put back in sequence order by the attention core, give each
    token the loss it has in the whole model (positions, causal mask, relative buckets and sliding windows
    follow the slice)."""
    from longspan.models.t5 import SequenceSlice, biased_attention, build_t5_model

    provider = tiny_t5(position_embedding_type=positions, window_size=window, window_attn_skip_freq=window and 2)
    whole = build_t5_model(provider, seed=6)
    sliced = build_t5_model(provider, seed=6)
    gen = torch.Generator().manual_seed(2)
    enc, dec = torch.randint(0, 90, (2, 16), generator=gen), torch.randint(0, 90, (2, 8), generator=gen)
    labels = torch.randint(0, 90, (2, 8), generator=gen)
    pad = torch.zeros(2, 1, 1, 16, dtype=torch.bool)
    pad[0, ..., 12:] = True
    enc_order, dec_order = torch.randperm(16, generator=gen), torch.randperm(8, generator=gen)
    restore = {16: enc_order.argsort(), 8: dec_order.argsort()}

    def in_sequence_order(q, k, v, bias, dropout_p, scale):
        back = restore[k.shape[2]]
        return biased_attention(q, k[:, :, back], v[:, :, back], bias, dropout_p, scale)

    for module in sliced.modules():
        if hasattr(module, "core_attention"):
            module.core_attention = in_sequence_order
    want = whole(enc, dec, encoder_attn_mask=pad, encoder_decoder_attn_mask=pad, lm_labels=labels)
    got = sliced(enc[:, enc_order], dec[:, dec_order], encoder_attn_mask=pad, encoder_decoder_attn_mask=pad,
                 lm_labels=labels[:, dec_order], encoder_slice=SequenceSlice(enc_order, 16),
                 decoder_slice=SequenceSlice(dec_order, 8))
    torch.testing.assert_close(got[:, restore[8]], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fields, counts", [
    (dict(), [3, 3]),
    (dict(num_layers_in_last_pipeline_stage=2), [4, 2]),
    (dict(num_layers_in_first_pipeline_stage=1), [1, 5]),
    (dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True), [3, 3]),
    (dict(account_for_embedding_in_pipeline_split=True), None),  # 7 slots over 2 stages
    (dict(virtual_pipeline_model_parallel_size=3), [1] * 6),
    (dict(encoder_pipeline_model_parallel_size=1), [3, 3]),
])
def test_t5_pipeline_split_counts_encoder_and_decoder_layers_together(fields, counts):
    """Megatron's split fields act on the encoder layers followed by the decoder layers (3 + 3 here)."""
    from longspan.core.pipeline_split import layer_counts_for_config

    provider = tiny_t5(num_layers=3, pipeline_model_parallel_size=2, share_embeddings_and_output_weights=False,
                       **fields)
    if counts is None:
        with pytest.raises(ConfigError, match=r"encoder_num_layers=3 \+ model.num_layers=3"):
            layer_counts_for_config(provider)
    else:
        assert layer_counts_for_config(provider) == counts


def test_fp32_residual_keeps_t5s_stream_in_float32_and_norm_outputs_in_the_parameters_dtype():
    """As GPT's: every layer takes and returns a float32 residual stream, its sub-layers get the norms' outputs in
    bf16, the logits stay bf16; a float32 model is unchanged. Chained pipeline stages (the encoder output sent in
    float32 to the decoder's cross-attention) equal the whole model."""
    from longspan.core.pipeline_split import layer_counts_for_config, stage_layer_numbers
    from longspan.models.t5 import build_t5_model

    gen = torch.Generator().manual_seed(1)
    enc, dec = torch.randint(0, 90, (2, 16), generator=gen), torch.randint(0, 90, (2, 8), generator=gen)
    fields = dict(params_dtype=torch.bfloat16, share_embeddings_and_output_weights=False, pipeline_model_parallel_size=2,
                  num_layers_in_first_pipeline_stage=2)
    provider = tiny_t5(fp32_residual_connection=True, **fields)
    model = build_t5_model(provider, seed=5).eval()
    seen = []
    for stack in (model.encoder, model.decoder):
        for layer in stack.layers.values():
            layer.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
            layer.self_attention.register_forward_pre_hook(lambda m, i: seen.append(i[0].dtype))
    with torch.no_grad():
        logits = model(enc, dec)
        plain = build_t5_model(tiny_t5(**fields), seed=5).eval()(enc, dec)
    assert seen == [torch.bfloat16, (torch.float32, torch.float32)] * 5 and logits.dtype == torch.bfloat16
    assert not torch.equal(plain, logits)
    numbers = stage_layer_numbers(layer_counts_for_config(provider))
    first, last = (build_t5_model(provider, seed=5, pre_process=i == 0, post_process=i == 1, layer_numbers=n).eval()
                   for i, n in enumerate(numbers))
    with torch.no_grad():
        hidden = first(enc, dec)
        assert hidden.dtype == torch.float32
        assert torch.equal(last(hidden, dec), logits)
    a, b = (build_t5_model(tiny_t5(fp32_residual_connection=f), seed=5).eval() for f in (False, True))
    with torch.no_grad():
        assert torch.equal(a(enc, dec), b(enc, dec))


def _band(queries: int, keys: int, left: int, right: int) -> torch.Tensor:
    """Hand-built window mask (True = masked), bottom-right aligned: query i sees keys
    i + keys - queries - left ... i + keys - queries + right."""
    i = torch.arange(queries)[:, None] + keys - queries
    j = torch.arange(keys)[None, :]
    return ((j < i - left) | (j > i + right))[None, None]


def test_sliding_window_reaches_every_t5_attention_as_megatron_does():
    """Megatron's T5 gives the window to each stack's layers by their number in that stack
    (``is_layer_window_attention``); the encoder sees ``left`` earlier and ``right`` later tokens, the causal
    decoder ``left`` earlier ones, cross-attention the band bottom-right aligned on the encoder. Windowed, the
    model equals the unwindowed one given those hand-built masks (merged with the padding mask)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    left, right = 2, 1
    windowed = tiny_t5(position_embedding_type="relative", window_size=[left, right])
    plain = tiny_t5(position_embedding_type="relative")
    gen = torch.Generator().manual_seed(5)
    enc, dec = torch.randint(0, 90, (2, 16), generator=gen), torch.randint(0, 90, (2, 8), generator=gen)
    pad = torch.zeros(2, 1, 1, 16, dtype=torch.bool)
    pad[1, ..., 11:] = True
    got = _logits(windowed, enc, dec, encoder_attn_mask=pad, encoder_decoder_attn_mask=pad)
    want = _logits(plain, enc, dec, encoder_attn_mask=pad | _band(16, 16, left, right),
                   decoder_attn_mask=_band(8, 8, left, 0), encoder_decoder_attn_mask=pad | _band(8, 16, left, right))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, _logits(plain, enc, dec, encoder_attn_mask=pad, encoder_decoder_attn_mask=pad),
                              atol=1e-4)
    # window_attn_skip_freq counts each stack's own layers (3 encoder, 2 decoder), as Megatron's T5 blocks do
    for skip in (2, [1, 0, 1]):
        model = tiny_t5(window_size=[left, right], window_attn_skip_freq=skip).provide()
        for stack in (model.encoder, model.decoder):
            flags = [layer.windowed for layer in stack.layers.values()]
            assert flags == [is_layer_window_attention((left, right), skip, n + 1) for n in range(len(flags))]
    # the layers that skip the window attend fully: the model differs from the all-windowed one
    skipping = tiny_t5(position_embedding_type="relative", window_size=[left, right], window_attn_skip_freq=2)
    assert not torch.allclose(_logits(skipping, enc, dec), _logits(windowed, enc, dec), atol=1e-4)


@pytest.mark.parametrize("fields, text", [
    (dict(window_size=[-2, 0]), r"window_size=\[-2, 0\]: each extent must be >= 0"),
    (dict(window_size=[4, 0], window_attn_skip_freq=[1, 0]), r"one 0/1 entry per layer \(3 layers"),
    (dict(window_attn_skip_freq=2), "window_attn_skip_freq=2 needs model.window_size"),
])
def test_bad_t5_window_settings_are_one_line_config_errors(fields, text):
    with pytest.raises(ConfigError, match=text):
        build_meta_model(tiny_t5(**fields))
