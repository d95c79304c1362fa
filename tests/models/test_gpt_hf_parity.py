"""GPTModel against HF transformers' LlamaForCausalLM and GPT2LMHeadModel (independent oracles)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import transformers  # the oracle: CI installs it (an import error fails loudly)

from tests.models.gpt_test_config import llama_config, make_config  # noqa: E402

from longspan.models.gpt import build_gpt_model  # noqa: E402


def _hf_llama(cfg, rope_parameters, tie: bool):
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.padded_vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        max_position_embeddings=131072,
        rms_norm_eps=cfg.layernorm_epsilon,
        tie_word_embeddings=tie,
        rope_parameters=rope_parameters,
        attention_dropout=0.0,
    )
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(hf_cfg).eval()


def _copy_llama_weights(hf, model, cfg) -> None:
    """HF Llama names -> longspan names (gate_proj = linear_fc1_gate, up_proj = linear_fc1)."""
    model.load_state_dict(_llama_to_longspan(hf.state_dict(), cfg), strict=True)


def _llama_to_longspan(sd, cfg) -> dict:
    ours = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
            "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not cfg.share_embeddings_and_output_weights:
        ours["output_layer.weight"] = sd["lm_head.weight"]
    names = {
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attn.q_proj.weight": "self_attention.linear_q.weight",
        "self_attn.k_proj.weight": "self_attention.linear_k.weight",
        "self_attn.v_proj.weight": "self_attention.linear_v.weight",
        "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
        "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
        "mlp.gate_proj.weight": "mlp.linear_fc1_gate.weight",
        "mlp.up_proj.weight": "mlp.linear_fc1.weight",
        "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    }
    for i in range(cfg.num_layers):
        for hf_name, our_name in names.items():
            ours[f"decoder.layers.{i}.{our_name}"] = sd[f"model.layers.{i}.{hf_name}"]
    return ours


def _gpt2_to_longspan(sd, cfg) -> dict:
    """HF GPT-2 names -> longspan names (Conv1D weights are [in, out]: transposed; c_attn is fused [q | k | v])."""
    h = cfg.hidden_size
    ours = {
        "embedding.word_embeddings.weight": sd["transformer.wte.weight"],
        "embedding.position_embeddings.weight": sd["transformer.wpe.weight"],
        "decoder.final_layernorm.weight": sd["transformer.ln_f.weight"],
        "decoder.final_layernorm.bias": sd["transformer.ln_f.bias"],
    }
    for i in range(cfg.num_layers):
        p, o = f"transformer.h.{i}.", f"decoder.layers.{i}."
        qkv_w, qkv_b = sd[p + "attn.c_attn.weight"].t(), sd[p + "attn.c_attn.bias"]
        for j, name in enumerate(("linear_q", "linear_k", "linear_v")):
            ours[o + f"self_attention.{name}.weight"] = qkv_w[j * h:(j + 1) * h]
            ours[o + f"self_attention.{name}.bias"] = qkv_b[j * h:(j + 1) * h]
        ours[o + "self_attention.linear_proj.weight"] = sd[p + "attn.c_proj.weight"].t()
        ours[o + "self_attention.linear_proj.bias"] = sd[p + "attn.c_proj.bias"]
        ours[o + "mlp.linear_fc1.weight"] = sd[p + "mlp.c_fc.weight"].t()
        ours[o + "mlp.linear_fc1.bias"] = sd[p + "mlp.c_fc.bias"]
        ours[o + "mlp.linear_fc2.weight"] = sd[p + "mlp.c_proj.weight"].t()
        ours[o + "mlp.linear_fc2.bias"] = sd[p + "mlp.c_proj.bias"]
        for a, b in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
            ours[o + f"{b}.weight"] = sd[p + f"{a}.weight"]
            ours[o + f"{b}.bias"] = sd[p + f"{a}.bias"]
    return ours


def _check_against_hf(cfg, hf, position_ids=None):
    model = build_gpt_model(cfg, seed=1).eval()
    _copy_llama_weights(hf, model, cfg)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (2, 12), generator=gen)
    with torch.no_grad():
        hf_out = hf(input_ids=tokens, position_ids=position_ids)
        logits = model(tokens, position_ids=position_ids)
        loss = model(tokens, position_ids=position_ids, labels=labels)
        # HF's own loss shifts labels by one: feed it our labels one step later and compare the mean.
        hf_labels = torch.cat([torch.full((2, 1), -100), labels[:, :-1]], dim=1)
        hf_loss = hf(input_ids=tokens, position_ids=position_ids, labels=hf_labels).loss
    torch.testing.assert_close(logits, hf_out.logits, atol=1e-5, rtol=1e-5)
    expected = F.cross_entropy(hf_out.logits.reshape(-1, hf_out.logits.shape[-1]), labels.reshape(-1), reduction="none")
    assert loss.dtype == torch.float32 and loss.shape == (2, 12)
    torch.testing.assert_close(loss, expected.view(2, 12), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss[:, :-1].mean(), hf_loss, atol=1e-5, rtol=1e-5)
    return model, tokens


@pytest.mark.parametrize("tie", [False, True])
def test_llama_gqa_untied_and_tied(tie):
    cfg = llama_config(share_embeddings_and_output_weights=tie)
    hf = _hf_llama(cfg, {"rope_type": "default", "rope_theta": cfg.rotary_base}, tie)
    model, _ = _check_against_hf(cfg, hf)
    assert (model.output_layer is None) == tie


def test_llama3_rope_scaling():
    cfg = llama_config(rotary_base=500000.0, rope_scaling=True, rope_scaling_factor=8.0)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = _hf_llama(cfg, rope, tie=False)
    with torch.no_grad():  # sharper attention, so positions (and their frequencies) move the logits
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    # Large positions make the scaled low frequencies matter.
    position_ids = torch.arange(5000, 5012).unsqueeze(0).expand(2, -1)
    _check_against_hf(cfg, hf, position_ids=position_ids)
    # The scaling is actually exercised: the unscaled model differs.
    unscaled = build_gpt_model(llama_config(rotary_base=500000.0), seed=1).eval()
    _copy_llama_weights(hf, unscaled, cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        diff = (unscaled(tokens, position_ids=position_ids) - hf(input_ids=tokens, position_ids=position_ids).logits)
    assert diff.abs().max() > 1e-4, diff.abs().max()


def test_gpt2_layernorm_learned_positions_gelu_biases():
    cfg = make_config(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=128,
        make_vocab_size_divisible_by=128, seq_length=16, normalization="LayerNorm", activation_func=F.gelu,
        add_bias_linear=True, add_qkv_bias=False, position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0,
    )
    hf_cfg = transformers.GPT2Config(
        vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=4, n_inner=256,
        activation_function="gelu", layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    ours = _gpt2_to_longspan(hf.state_dict(), cfg)
    model = build_gpt_model(cfg, seed=1).eval()
    model.load_state_dict(ours, strict=True)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    labels = torch.roll(tokens, -1, dims=1)
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        logits = model(tokens)
        loss = model(tokens, labels=labels)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    ce = F.cross_entropy(expected.reshape(-1, 128), labels.reshape(-1), reduction="none").view(2, 16)
    torch.testing.assert_close(loss, ce, atol=1e-5, rtol=1e-5)


def test_qwen3_qk_layernorm_and_explicit_kv_channels():
    """Per-head QK RMSNorm before RoPE and a head width other than hidden/heads (HF Qwen3 as the oracle)."""
    cfg = llama_config(kv_channels=24, qk_layernorm=True, add_qkv_bias=False)
    hf_cfg = transformers.Qwen3Config(
        vocab_size=cfg.padded_vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, head_dim=24, max_position_embeddings=4096,
        rms_norm_eps=cfg.layernorm_epsilon, tie_word_embeddings=False, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base}, use_sliding_window=False,
    )
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a misplaced norm would show
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model = build_gpt_model(cfg, seed=1).eval()
    sd = hf.state_dict()
    ours = _llama_to_longspan(sd, cfg)  # Qwen3 uses Llama's names for everything but the QK norms
    for i in range(cfg.num_layers):
        ours[f"decoder.layers.{i}.self_attention.q_layernorm.weight"] = sd[f"model.layers.{i}.self_attn.q_norm.weight"]
        ours[f"decoder.layers.{i}.self_attention.k_layernorm.weight"] = sd[f"model.layers.{i}.self_attn.k_norm.weight"]
    model.load_state_dict(ours, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(input_ids=tokens).logits, atol=1e-5, rtol=1e-5)


def test_qwen2_qkv_bias_only():
    """add_qkv_bias with add_bias_linear=False: biases on q/k/v only (HF Qwen2 as the oracle)."""
    cfg = llama_config(add_qkv_bias=True)
    hf_cfg = transformers.Qwen2Config(
        vocab_size=cfg.padded_vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, max_position_embeddings=4096, rms_norm_eps=cfg.layernorm_epsilon,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
        use_sliding_window=False,
    )
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model = build_gpt_model(cfg, seed=1).eval()
    assert model.decoder.layers["0"].self_attention.linear_proj.bias is None
    sd = hf.state_dict()
    ours = _llama_to_longspan(sd, cfg)
    for i in range(cfg.num_layers):
        for hf_name, name in (("q_proj", "linear_q"), ("k_proj", "linear_k"), ("v_proj", "linear_v")):
            ours[f"decoder.layers.{i}.self_attention.{name}.bias"] = sd[f"model.layers.{i}.self_attn.{hf_name}.bias"]
    model.load_state_dict(ours, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(input_ids=tokens).logits, atol=1e-5, rtol=1e-5)
