"""The gated DeltaNet layer (longspan.models.gated_delta_rule / gated_delta_net) and the hybrid GPT stack around it:
the rule's two forms against each other and against transformers' own torch fallbacks, the mixer against
transformers' Qwen3_5GatedDeltaNet, packed documents (outputs and gradients as if alone; a state carried across a
boundary is caught), decoding with the cache, the attention output gate, the layer pattern and the config rules."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from longspan.config.rules.validate import validate_container
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.data.tokenizers import NullTokenizer
from longspan.inference.text_generation import generate
from longspan.models.gated_delta_rule import (
    DocumentLayout,
    chunk_gated_delta_rule,
    chunked_gated_delta_rule,
    flash_linear_attention_rule,
    recurrent_gated_delta_rule,
)
from longspan.models.gpt import build_gpt_model
from longspan.models.layer_pattern import linear_attention_layer_flags, linear_attention_pattern_from_layer_types
from longspan.models.transformer import KVCache
from longspan.training.step.forward_step import _mtp_inputs
from tests.models.gpt_test_config import llama_config
from tests.training.pretrain_helpers import small_config

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

DELTANET = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=2, linear_conv_kernel_dim=4,
                linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2, linear_num_value_heads=4)


def _rule_inputs(b: int, s: int, key_heads: int = 2, value_heads: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, s, key_heads, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(b, s, key_heads, dk, generator=gen), dim=-1)
    v = torch.randn(b, s, value_heads, dv, generator=gen)
    g = -F.softplus(torch.randn(b, s, value_heads, generator=gen))
    beta = torch.rand(b, s, value_heads, generator=gen)
    state = torch.randn(b, value_heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("seq_len", [1, 5, 37, 70])
@pytest.mark.parametrize("chunk_size", [1, 8, 16, 64])
def test_chunked_rule_equals_recurrent_and_transformers(seq_len: int, chunk_size: int) -> None:
    q, k, v, g, beta, state = _rule_inputs(2, seq_len)
    theirs, their_state = qwen3_5.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                                   output_final_state=True)
    their_chunked, _ = qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size,
                                                            initial_state=state, output_final_state=True)
    ours, our_state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=state,
                                             output_final_state=True)
    steps, step_state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    for out in (ours, steps, their_chunked):
        torch.testing.assert_close(out, theirs, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(our_state, their_state, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(step_state, their_state, atol=2e-6, rtol=1e-5)


def test_rule_from_a_zero_state_and_its_gradients_match_transformers() -> None:
    inputs = [t.requires_grad_() for t in _rule_inputs(1, 23, seed=3)[:5]]
    ours, _ = chunk_gated_delta_rule(*inputs, chunk_size=8)
    grads = torch.autograd.grad(ours.square().sum(), inputs)
    theirs, _ = qwen3_5.torch_recurrent_gated_delta_rule(*inputs)
    their_grads = torch.autograd.grad(theirs.square().sum(), inputs)
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)
    for mine, reference in zip(grads, their_grads):
        torch.testing.assert_close(mine, reference, atol=1e-5, rtol=1e-5)


def test_rule_restarts_at_every_packed_document() -> None:
    lengths = [5, 11, 8]
    q, k, v, g, beta, _ = _rule_inputs(1, sum(lengths), seed=5)
    cu = torch.tensor([0, 5, 16, 24])
    for rule in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        packed, _ = rule(q, k, v, g, beta, cu_seqlens=cu)
        for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone, _ = rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi])
            torch.testing.assert_close(packed[:, lo:hi], alone, atol=1e-6, rtol=1e-6)


def test_document_layout_covers_every_position_once_with_padded_boundaries() -> None:
    # [b, n] boundaries with a repeated end (the packing collate's padding) and a row ending before the sequence
    cu = torch.tensor([[0, 3, 7, 7], [0, 2, 5, 5]])
    layout = DocumentLayout.from_cu_seqlens(cu, batch=2, seq_len=7)
    x = torch.arange(14.0).view(2, 7, 1)
    rows = layout.split(x)
    assert rows.shape[0] == 5  # 3 + 4, then 2 + 3 + the tail after position 5
    torch.testing.assert_close(layout.merge(rows), x)


@pytest.mark.skipif(not torch.cuda.is_available() or flash_linear_attention_rule() is None,
                    reason="needs CUDA and the flash-linear-attention extra")
def test_flash_linear_attention_kernel_matches_the_plain_rule_within_bf16_tolerance() -> None:
    q, k, v, g, beta, state = _rule_inputs(2, 300, key_heads=2, value_heads=4, dk=64, dv=64)
    reference, ref_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    cuda = [t.cuda().to(torch.bfloat16) for t in (q, k, v)] + [g.cuda(), beta.cuda().to(torch.bfloat16)]
    out, final = chunked_gated_delta_rule(*cuda, initial_state=state.cuda(), output_final_state=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), reference, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(final.cpu(), ref_state, atol=5e-2, rtol=5e-2)


# ---- the mixer against transformers' Qwen3_5GatedDeltaNet ------------------------------------------------------

def _hf_deltanet(hidden: int = 64):
    config = qwen3_5.Qwen3_5TextConfig(
        hidden_size=hidden, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["linear_attention", "full_attention"], rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    module = qwen3_5.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return module


def _load_from_hf(mixer: torch.nn.Module, hf: torch.nn.Module) -> None:
    key_dim = mixer.linear_q.weight.shape[0]
    with torch.no_grad():
        q, k, v = hf.in_proj_qkv.weight.split([key_dim, key_dim, mixer.linear_v.weight.shape[0]])
        cq, ck, cv = hf.conv1d.weight.split([key_dim, key_dim, mixer.linear_v.weight.shape[0]])
        pairs = {"linear_q": q, "linear_k": k, "linear_v": v, "linear_z": hf.in_proj_z.weight,
                 "linear_b": hf.in_proj_b.weight, "linear_a": hf.in_proj_a.weight, "conv_q": cq, "conv_k": ck,
                 "conv_v": cv, "linear_proj": hf.out_proj.weight, "norm": hf.norm.weight}
        for name, weight in pairs.items():
            getattr(mixer, name).weight.copy_(weight)
        mixer.dt_bias.copy_(hf.dt_bias)
        mixer.A_log.copy_(hf.A_log)


def _deltanet_model(**overrides):
    values = dict(DELTANET)
    values.update(overrides)
    return build_gpt_model(llama_config(num_layers=4, **values), seed=7)


def test_mixer_equals_transformers_qwen3_5_gated_deltanet() -> None:
    hf = _hf_deltanet()
    model = _deltanet_model()
    mixer = model.decoder.layers["0"].self_attention
    _load_from_hf(mixer, hf)
    x = torch.randn(2, 29, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(mixer(x), hf(x), atol=1e-5, rtol=1e-5)


# ---- the hybrid stack: pattern, packing, cache, gradients ----------------------------------------------------

def test_layer_pattern_puts_deltanet_in_the_self_attention_slot() -> None:
    assert linear_attention_layer_flags(4, 8) == [True, True, True, False] * 2
    assert linear_attention_layer_flags([1, 0, 0, 1], 4) == [True, False, False, True]
    assert linear_attention_pattern_from_layer_types(["linear_attention", "full_attention"]) == [1, 0]
    model = _deltanet_model(linear_attention_freq=[1, 1, 0, 1])
    kinds = [type(layer.self_attention).__name__ for layer in model.decoder.layers.values()]
    assert kinds == ["GatedDeltaNet", "GatedDeltaNet", "SelfAttention", "GatedDeltaNet"]


def _packed_inputs(lengths: list[int], vocab: int = 128, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (1, n), generator=gen) for n in lengths]
    total = sum(lengths)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    mask = torch.ones(total, total, dtype=torch.bool)  # True = masked
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        mask[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).triu(1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return docs, torch.cat(docs, dim=1), mask[None, None], positions, bounds


def test_packed_documents_get_the_logits_and_gradients_they_have_alone() -> None:
    lengths = [5, 19, 8]
    model = _deltanet_model(linear_attention_freq=[1, 1, 0, 1])
    docs, tokens, mask, positions, cu = _packed_inputs(lengths)
    labels = torch.roll(tokens, -1, dims=1)
    packed_loss = model(tokens, position_ids=positions, attention_mask=mask, labels=labels, cu_seqlens=cu)
    packed_logits = model(tokens, position_ids=positions, attention_mask=mask, cu_seqlens=cu)
    packed_grads = torch.autograd.grad(packed_loss.sum(), list(model.parameters()))
    alone_grads = None
    for doc, lo, hi in zip(docs, cu[:-1].tolist(), cu[1:].tolist()):
        logits = model(doc)
        torch.testing.assert_close(packed_logits[:, lo:hi], logits, atol=1e-5, rtol=0)
        loss = model(doc, labels=labels[:, lo:hi])
        grads = torch.autograd.grad(loss.sum(), list(model.parameters()))
        alone_grads = grads if alone_grads is None else [a + g for a, g in zip(alone_grads, grads)]
    for packed, alone in zip(packed_grads, alone_grads):
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


def test_a_state_carried_across_a_boundary_is_caught() -> None:
    """Without cu_seqlens the block-diagonal mask still separates the attention layers, but the DeltaNet state
    (and its conv window) runs on into the next document: the second document's logits change. So the packed test
    above fails if a layer carries its state across."""
    model = _deltanet_model(linear_attention_freq=[1, 1, 0, 1])
    docs, tokens, mask, positions, cu = _packed_inputs([6, 9])
    with torch.no_grad():
        alone = model(docs[1])
        reset = model(tokens, position_ids=positions, attention_mask=mask, cu_seqlens=cu)[:, 6:]
        carried = model(tokens, position_ids=positions, attention_mask=mask)[:, 6:]
    torch.testing.assert_close(reset, alone, atol=1e-5, rtol=0)
    assert (carried - alone).abs().max() > 1e-3


@pytest.mark.parametrize("conv_kernel", [1, 4])
def test_decoding_with_the_cache_equals_the_full_forward(conv_kernel: int) -> None:
    model = _deltanet_model(linear_conv_kernel_dim=conv_kernel, attention_output_gate=True).eval()
    tokens = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(21)
        pieces = [model(tokens[:, :7], kv_cache=cache)]  # prefill
        pieces += [model(tokens[:, t:t + 1], kv_cache=cache) for t in range(7, 12)]  # one token at a time
        pieces.append(model(tokens[:, 12:], kv_cache=cache))  # several tokens after cached ones
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
    assert set(cache.linear_states) == {0, 2} and cache.nbytes() > 0


def test_full_recompute_keeps_the_packed_documents_apart() -> None:
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    models = [_deltanet_model(**extra) for extra in ({}, recompute)]
    tokens = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(8))
    cu = torch.tensor([0, 7, 20])
    grads = []
    for model in models:
        model(tokens, labels=tokens, cu_seqlens=cu).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, atol=0, rtol=0)


def test_bf16_parameters_run_forward_backward_and_decode() -> None:
    model = _deltanet_model(params_dtype=torch.bfloat16, attention_output_gate=True)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(9))
    model(tokens, labels=tokens, cu_seqlens=torch.tensor([0, 5, 12])).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())
    cache = KVCache(13)
    with torch.no_grad():
        steps = torch.cat([model(tokens[:, :11], kv_cache=cache), model(tokens[:, 11:], kv_cache=cache)], dim=1)
        torch.testing.assert_close(steps, model(tokens), atol=2e-2, rtol=2e-2)


def test_greedy_generate_is_the_same_with_and_without_the_cache() -> None:
    model = _deltanet_model(attention_output_gate=True, init_method_std=0.2)
    prompt = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    runs = [generate(model, NullTokenizer(127), prompt, max_new_tokens=12, use_cache=cached, eos_ids=())
            for cached in (True, False)]
    assert runs[0].output_ids == runs[1].output_ids and len(set(runs[0].output_ids)) > 1


def test_gradients_reach_every_parameter() -> None:
    model = _deltanet_model(attention_output_gate=True)
    tokens = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(4))
    model(tokens, labels=torch.roll(tokens, -1, 1)).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


def test_attention_output_gate_multiplies_by_the_sigmoid_of_linear_gate() -> None:
    model = build_gpt_model(llama_config(attention_output_gate=True), seed=3).eval()
    attention = model.decoder.layers["0"].self_attention
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0))
    core, captured = attention.core_attention, []

    def recording_core(*args):
        captured.append(core(*args))
        return captured[-1]

    attention.core_attention = recording_core
    with torch.no_grad():
        gated = attention(x)
        core_out = captured[0].transpose(1, 2).reshape(2, 9, -1)
        expected = attention.linear_proj(core_out * torch.sigmoid(attention.linear_gate(x)))
        ungated = attention.linear_proj(core_out)
    torch.testing.assert_close(gated, expected, atol=1e-6, rtol=1e-6)
    assert (gated - ungated).abs().max() > 1e-3


# ---- config rules ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, error, words", [
    (dict(linear_conv_kernel_dim=0), ConfigError, "linear_conv_kernel_dim=0"),
    (dict(linear_num_value_heads=3), ConfigError, "multiple of model.linear_num_key_heads"),
    (dict(tensor_model_parallel_size=4, linear_num_key_heads=2), ConfigError, "linear_num_key_heads=2"),
    (dict(linear_attention_freq=None), ConfigError, "needs model.linear_attention_freq"),
    (dict(linear_attention_freq=[1, 0]), ConfigError, "one 0/1 entry per layer"),
    (dict(linear_attention_freq=0), ConfigError, "linear_attention_freq=0"),
    (dict(experimental_attention_variant="dsa"), NotSupportedError, "experimental_attention_variant='dsa'"),
    (dict(experimental_attention_variant=None), ConfigError, "needs model.experimental_attention_variant"),
])
def test_bad_deltanet_fields_are_one_line_errors(fields, error, words) -> None:
    values = dict(DELTANET)
    values.update(fields)
    with pytest.raises(error) as caught:
        build_gpt_model(llama_config(num_layers=4, **values), materialize=False)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_the_forward_step_passes_packed_documents_to_a_deltanet_model() -> None:
    batch = {"tokens": torch.zeros(1, 4), "loss_mask": torch.ones(1, 4), "cu_seqlens": torch.tensor([[0, 2, 4]])}
    state = types.SimpleNamespace(cfg=types.SimpleNamespace(model=llama_config(num_layers=4, **DELTANET)))
    assert _mtp_inputs(state, batch) == {"cu_seqlens": batch["cu_seqlens"]}
    state.cfg.model = llama_config()
    assert _mtp_inputs(state, batch) == {}


def test_gpt_data_with_reset_attention_mask_is_refused_for_deltanet_layers(tmp_path) -> None:
    cfg = small_config(tmp_path)
    for name, value in DELTANET.items():
        setattr(cfg.model, name, value)
    cfg.dataset.reset_attention_mask = True
    with pytest.raises(NotSupportedError, match="dataset.reset_attention_mask=True"):
        validate_container(cfg, world_size=1)
    cfg.dataset.reset_attention_mask = False
    validate_container(cfg, world_size=1)


def test_context_parallel_builds_when_it_splits_the_heads() -> None:
    """Context parallel exchanges heads (longspan.parallel.gated_delta_net; tests/parallel/
    test_gated_delta_net_layouts.py trains under it): the model builds."""
    build_gpt_model(llama_config(num_layers=4, context_parallel_size=2, **DELTANET), materialize=False)
