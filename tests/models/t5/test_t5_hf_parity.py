"""T5 through AutoBridge against transformers' T5ForConditionalGeneration / MT5 (independent oracle)."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
import transformers

from longspan.conversion import AutoBridge
from longspan.core.errors import NotSupportedError
from longspan.models import T5ModelProvider


def _hf_t5(tmp_path, *, cls=transformers.T5ForConditionalGeneration, config_cls=transformers.T5Config, **kw):
    cfg = config_cls(vocab_size=100, d_model=32, d_kv=12, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=12, dropout_rate=0.0,
                     decoder_start_token_id=0, **kw)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # HF initializes some tensors (layer norms) to constants: make every tensor distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    path = tmp_path / "hf"
    model.save_pretrained(path)
    return model, path


def _batch():
    g = torch.Generator().manual_seed(1)
    enc = torch.randint(2, 100, (3, 17), generator=g)
    dec = torch.randint(2, 100, (3, 9), generator=g)
    enc_keep = torch.ones(3, 17, dtype=torch.long)
    enc_keep[0, 11:] = 0  # uneven padding
    enc_keep[2, 15:] = 0
    dec_keep = torch.ones(3, 9, dtype=torch.long)
    dec_keep[1, 6:] = 0
    return enc, dec, enc_keep, dec_keep


def _ours(model, enc, dec, enc_keep, dec_keep, **kw):
    enc_pad = enc_keep == 0
    return model(
        enc, dec,
        encoder_attn_mask=enc_pad[:, None, None, :],
        decoder_attn_mask=(dec_keep == 0)[:, None, None, :],
        encoder_decoder_attn_mask=enc_pad[:, None, None, :],
        **kw,
    )


@pytest.mark.parametrize(
    "kind",
    ["t5_v1_1_gated_gelu", "t5_v1_0_relu_scaled", "mt5"],
)
def test_logits_equal_transformers_and_export_is_bit_exact(tmp_path, kind):
    if kind == "t5_v1_1_gated_gelu":
        hf, path = _hf_t5(tmp_path, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    elif kind == "t5_v1_0_relu_scaled":
        hf, path = _hf_t5(tmp_path, feed_forward_proj="relu", tie_word_embeddings=True)
    else:
        hf, path = _hf_t5(tmp_path, cls=transformers.MT5ForConditionalGeneration, config_cls=transformers.MT5Config,
                          feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    bridge = AutoBridge.from_hf_pretrained(path)
    provider = bridge.to_megatron_provider()
    assert isinstance(provider, T5ModelProvider)
    assert provider.scale_decoder_outputs == getattr(hf.config, "scale_decoder_outputs", False)
    (model,) = bridge.to_megatron_model()
    model.eval()
    enc, dec, enc_keep, dec_keep = _batch()
    with torch.no_grad():
        want = hf(input_ids=enc, attention_mask=enc_keep, decoder_input_ids=dec,
                  decoder_attention_mask=dec_keep).logits
        got = _ours(model, enc, dec, enc_keep, dec_keep)[..., :100]
    assert (got - want).abs().max().item() <= 1e-5
    # loss: ours per token equals HF's mean over the same tokens
    labels = torch.randint(0, 100, dec.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = _ours(model, enc, dec, enc_keep, dec_keep, lm_labels=labels)
        hf_loss = hf(input_ids=enc, attention_mask=enc_keep, decoder_input_ids=dec, decoder_attention_mask=dec_keep,
                     labels=labels).loss
    assert abs(ours.mean().item() - hf_loss.item()) <= 1e-5

    exported = {name: t.clone() for name, t in bridge.export_hf_weights([model])}
    original = safetensors.torch.load_file(str(path / "model.safetensors"))
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    out = tmp_path / "exported"
    bridge.save_hf_pretrained([model], out)
    reloaded = type(hf).from_pretrained(out).eval()
    with torch.no_grad():
        again = reloaded(input_ids=enc, attention_mask=enc_keep, decoder_input_ids=dec,
                         decoder_attention_mask=dec_keep).logits
    assert torch.equal(again, want)


def test_longspan_t5_exports_as_t5_and_loads_in_transformers(tmp_path):
    """A T5 built from a recipe-style provider (not imported) exports through from_longspan_provider."""
    import torch.nn.functional as F

    provider = T5ModelProvider(num_layers=2, encoder_num_layers=1, hidden_size=32, num_attention_heads=4,
                               ffn_hidden_size=40, vocab_size=96, make_vocab_size_divisible_by=32,
                               position_embedding_type="relative", normalization="RMSNorm", add_bias_linear=False,
                               softmax_scale=1.0, activation_func=F.relu, share_embeddings_and_output_weights=True,
                               hidden_dropout=0.0, attention_dropout=0.0, seq_length=16, seq_length_dec=8)
    provider.finalize()
    model = provider.provide().eval()
    bridge = AutoBridge.from_longspan_provider(provider)
    assert bridge.family.architecture == "T5ForConditionalGeneration"
    bridge.save_hf_pretrained([model], tmp_path / "hf")
    hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    enc, dec, enc_keep, dec_keep = _batch()
    enc, dec = enc % 96, dec % 96
    with torch.no_grad():
        want = hf(input_ids=enc, attention_mask=enc_keep, decoder_input_ids=dec, decoder_attention_mask=dec_keep).logits
        got = _ours(model, enc, dec, enc_keep, dec_keep)
    assert (got - want).abs().max().item() <= 1e-5


def test_unsupported_t5_variants_are_one_line_errors(tmp_path):
    hf, path = _hf_t5(tmp_path, feed_forward_proj="gated-gelu")
    cfg = dict(AutoBridge.from_hf_pretrained(path).hf_config, feed_forward_proj="gated-tanh")
    with pytest.raises(NotSupportedError, match="feed_forward_proj='gated-tanh'"):
        AutoBridge.from_hf_config(cfg).to_megatron_provider()
    windowed = T5ModelProvider(num_layers=2, hidden_size=32, num_attention_heads=4, window_size=[4, 4])
    with pytest.raises(NotSupportedError, match="HF T5 attends fully"):
        AutoBridge.from_longspan_provider(windowed).family.to_hf(windowed)
    with pytest.raises(NotSupportedError, match="UMT5ForConditionalGeneration"):
        AutoBridge.from_hf_config({"architectures": ["UMT5ForConditionalGeneration"], "model_type": "umt5"})
