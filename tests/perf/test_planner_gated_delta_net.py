"""The planner on a gated DeltaNet hybrid: linear-attention layers cost per token (no s^2 core) and are measured
as a layer kind of their own (their saved state instead of attention's keys and values)."""

from __future__ import annotations

import copy

from longspan.parallel.mesh import Layout
from longspan.planner.activations import activation_parts, stage_activations
from longspan.planner.flops import matmul_terms, num_floating_point_operations
from longspan.recipes import get_recipe


def _all_attention(cfg):
    full = copy.deepcopy(cfg)
    full.model.experimental_attention_variant = None
    full.model.linear_attention_freq = None
    return full


def test_linear_layers_have_no_quadratic_term_and_count_their_own_matmuls() -> None:
    cfg = get_recipe("qwen35")
    cfg.peft = None
    model = cfg.model
    hybrid, full = matmul_terms(model), matmul_terms(_all_attention(cfg).model)
    assert hybrid.core == full.core / 4  # one layer in four is softmax attention
    h, heads = model.hidden_size, model.linear_num_value_heads
    k, v = model.linear_key_head_dim, model.linear_value_head_dim
    key, value = model.linear_num_key_heads * k, heads * v
    gdn = h * (2 * key + 2 * value + 2 * heads) + value * h + (2 * key + value) * model.linear_conv_kernel_dim
    gdn += 4 * heads * k * v
    q = model.kv_channels * model.num_attention_heads
    attention = h * (q + 2 * model.kv_channels * model.num_query_groups) + q * h + h * q  # + the output gate
    mlp = 3 * h * model.ffn_hidden_size
    layers = model.num_layers
    assert hybrid.weights == 18 * (gdn + mlp) + 6 * (attention + mlp) + h * model.vocab_size
    # doubling the sequence doubles the linear layers' cost, the attention layers' grows faster
    long = copy.deepcopy(cfg)
    long.model.seq_length *= 2
    ratio = num_floating_point_operations(long, 1) / num_floating_point_operations(cfg, 1)
    full_ratio = (num_floating_point_operations(_all_attention(long), 1)
                  / num_floating_point_operations(_all_attention(cfg), 1))
    assert 2.0 < ratio < full_ratio and layers == 24


def test_linear_layers_are_a_measured_layer_kind() -> None:
    cfg = get_recipe("qwen35")
    cfg.model.seq_length = 256
    parts = activation_parts(cfg, Layout(world_size=1))
    assert parts["linear_dense_layer"] > 0 and parts["dense_layer"] > 0 and parts["moe_layer"] == 0
    layers = list(range(cfg.model.num_layers))
    assert stage_activations(cfg, parts, layers) == 18 * parts["linear_dense_layer"] + 6 * parts["dense_layer"]
    tp2 = activation_parts(cfg, Layout(world_size=2, tp=2))
    assert tp2["linear_dense_layer"] < parts["linear_dense_layer"]  # DeltaNet heads divided by tp
