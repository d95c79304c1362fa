"""Attention sinks, the clamped/offset gated MLP and the router bias (GPT-OSS's model features), checked
against transformers' own GPT-OSS functions; models without sinks keep the fused SDPA path."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss as hf

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.activations import gated_activation, quick_gelu
from longspan.models.args import TransformerArgs
from longspan.models.attention_sinks import sink_core_attention
from longspan.models.sliding_window import WindowedMask
from longspan.models.transformer import SelfAttention, core_attention
from tests.models.gpt_test_config import llama_config


def _hf_attention(q, k, v, sinks, window=None):
    """transformers' eager GPT-OSS attention with its additive causal (optionally sliding) mask."""
    s = q.shape[2]
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    mask = torch.zeros(s, s).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks, training=False)
    out, _ = hf.eager_attention_forward(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)  # [b, heads, s, d], as ours


@pytest.mark.parametrize("window", [None, 3])
def test_sink_attention_equals_transformers(window):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 10, 8, generator=g)
    k, v = torch.randn(2, 2, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    sinks = torch.randn(4, generator=g) * 2
    mask = None if window is None else WindowedMask(window, None)
    ours = sink_core_attention(q, k, v, mask, 0.0, None, sinks=sinks)
    expected = _hf_attention(q, k, v, sinks, window)
    assert (ours - expected).abs().max().item() <= 1e-6
    # the sink takes probability mass: without it the result is plain attention, which differs
    assert (ours - core_attention(q, k, v, mask, 0.0, None)).abs().max().item() > 1e-3


def _attention(**overrides) -> SelfAttention:
    args = TransformerArgs.from_config(llama_config(**overrides))
    return SelfAttention(args, 0)


def test_vanilla_keeps_sdpa_and_learnable_has_a_parameter_per_head():
    assert _attention().core_attention is core_attention and _attention().softmax_offset is None
    sinks = _attention(softmax_type="learnable")
    assert tuple(sinks.softmax_offset.shape) == (4,)
    assert _attention(softmax_type="off-by-one").softmax_offset is None


def test_off_by_one_is_a_zero_logit():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 6, 16, generator=g) for _ in range(3))
    ours = _attention(softmax_type="off-by-one").core_attention(q, k, v, None, 0.0, None)
    assert torch.allclose(ours, sink_core_attention(q, k, v, None, 0.0, None, sinks=torch.zeros(4)))


def test_clamped_offset_glu_equals_transformers():
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(5, 12, generator=g) * 10  # values well past the clamp
    experts = types.SimpleNamespace(limit=7.0, alpha=1.702)
    expected = hf.GptOssExperts._apply_gate(experts, gate_up)
    ours = gated_activation(gate_up[..., ::2], gate_up[..., 1::2], quick_gelu, 1.0, 7.0)
    assert torch.equal(ours, expected)


def test_router_bias_changes_the_logits():
    from longspan.models.moe import MoELayer

    args = TransformerArgs.from_config(llama_config(num_moe_experts=4, moe_router_topk=2, add_bias_linear=True))
    layer = MoELayer(args, 0)
    assert tuple(layer.router.bias.shape) == (4,)
    no_bias = MoELayer(TransformerArgs.from_config(llama_config(num_moe_experts=4, moe_router_topk=2)), 0)
    assert no_bias.router.bias is None


@pytest.mark.parametrize("overrides, error", [
    (dict(softmax_type="softer"), ConfigError),
    (dict(softmax_type="learnable", context_parallel_size=2), NotSupportedError),
    (dict(softmax_type="learnable", attn_logit_softcapping=5.0), NotSupportedError),
    (dict(glu_linear_offset=1.0, gated_linear_unit=False), ConfigError),
    (dict(activation_func_clamp_value=-1.0), ConfigError),
])
def test_rules_refuse_in_one_line(overrides, error):
    with pytest.raises(error) as info:
        TransformerArgs.from_config(llama_config(**overrides))
    assert "\n" not in str(info.value) and "model." in str(info.value)
