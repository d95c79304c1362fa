"""Model FLOPs of multi-latent attention, multi-token prediction, DeepSeek MoE layers and PEFT runs.

Each formula is checked twice: against a hand count written out GEMM by GEMM, and against a census of the
model actually built (meta device): every weight matrix a token multiplies through (routed experts: top-k of
E), the norms Megatron's formula counts, and the output layer once per prediction head.
"""

from __future__ import annotations

import pytest
from torch import nn

from longspan.models.moe import GroupedLinear
from longspan.peft import LoRA
from longspan.peft.adapters import apply_adapters
from longspan.planner.flops import adapter_multiply_adds_per_token, matmul_terms, num_floating_point_operations
from longspan.recipes import get_recipe

SEQ, BATCH = 256, 2


def _deepseek(q_lora_rank=64, mtp_num_layers=1):
    """tiny-deepseek: h 128, 8 heads, MLA (kv_lora_rank 32, qk 16 + rope 8, v 16), layer 0 dense (SwiGLU 512),
    layers 1-3 MoE (8 experts of 128, top-2, one shared expert of 128), vocabulary 4096, sequence 256."""
    cfg = get_recipe("tiny-deepseek")
    cfg.model.vocab_size = 4096
    cfg.model.q_lora_rank = q_lora_rank
    cfg.model.mtp_num_layers = mtp_num_layers
    cfg.model.finalize()
    return cfg


def _dense_gqa():
    """The tiny recipe shrunk: 2 layers, h 64, 4 heads / 2 kv groups of 16, SwiGLU 128, vocabulary 256."""
    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 2, 64, 128
    m.num_attention_heads, m.num_query_groups, m.kv_channels = 4, 2, 16
    m.vocab_size, m.seq_length = 256, 32
    m.finalize()
    return cfg


# ------------------------------------------------------------------------------------------ hand counts

def _mla_hand_count(q_lora: bool) -> int:
    """Forward multiply-adds per token of one tiny-deepseek MLA layer's projections (and latent norms)."""
    h, heads, q_rank, kv_rank, qk, pe, v = 128, 8, 64, 32, 16, 8, 16
    if q_lora:
        query = h * q_rank + q_rank + q_rank * heads * (qk + pe)  # down 8192, q_layernorm 64, up 12288
    else:
        query = h * heads * (qk + pe)  # linear_q_proj 24576
    kv_down = h * (kv_rank + pe)  # 5120: the latent and the shared rotary key
    kv_norm = kv_rank  # 32
    kv_up = kv_rank * heads * (qk + v)  # 8192: per head the key's position-free part and the value
    out = heads * v * h  # 16384
    return query + kv_down + kv_norm + kv_up + out


@pytest.mark.parametrize("q_lora", [True, False])
def test_mla_and_mtp_flops_equal_the_hand_count(q_lora):
    cfg = _deepseek(q_lora_rank=64 if q_lora else None, mtp_num_layers=1)
    h, V = 128, 4096
    attention = _mla_hand_count(q_lora)
    assert attention == (50272 if q_lora else 54304)
    dense_mlp = 3 * h * 512  # gate, up, down of the dense first layer
    moe_mlp = 3 * h * (2 * 128 + 128)  # two routed experts and the shared expert, SwiGLU
    mtp_extra = 2 * h * h + 3 * h  # eh_proj [h, 2h]; enorm, hnorm, final norm
    decoder = 4 * attention + dense_mlp + 3 * moe_mlp
    mtp = attention + moe_mlp + mtp_extra  # the depth's layer is built like the last (MoE) layer
    logits = 2 * h * V  # main head and the MTP depth share the output layer
    weights = decoder + mtp + logits
    # core per position: Q.K^T over 8 x 24 channels and P.V over 8 x 16; causal: half the positions
    core_per_layer = 8 * (16 + 8) + 8 * 16
    tokens = BATCH * SEQ
    expected = 6 * weights * tokens + 6 * (5 * core_per_layer / 2) * tokens * SEQ
    assert matmul_terms(cfg.model).weights == weights
    assert num_floating_point_operations(cfg, BATCH) == expected
    # without MTP: the depth's layer, projection, norms and second logits go away
    no_mtp = _deepseek(q_lora_rank=64 if q_lora else None, mtp_num_layers=None)
    assert num_floating_point_operations(no_mtp, BATCH) == (
        6 * (decoder + h * V) * tokens + 6 * (4 * core_per_layer / 2) * tokens * SEQ)


# ------------------------------------------------------------------------------------------ census of the model

def _census(model: nn.Module, topk: int, depths: int) -> float:
    """Multiply-adds per token read off the built model: every linear weight (routed experts: top-k of E), the
    latent and MTP norms (Megatron counts them), and the output layer once per prediction head."""
    total = 0.0
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, GroupedLinear):
            total += module.weight.numel() * topk / module.weight.shape[0]
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * (depths + 1 if name == "output_layer" else 1)
        elif leaf in ("q_layernorm", "kv_layernorm") or (name.startswith("mtp.") and leaf in (
                "enorm", "hnorm", "final_layernorm")):
            total += module.weight.numel()
    if getattr(model, "output_layer", None) is None:  # tied: the word embedding is the output weight
        total += model.embedding.word_embeddings.weight.numel() * (depths + 1)
    return total


@pytest.mark.parametrize("q_lora_rank,depths", [(64, 2), (None, 1), (64, None)])
def test_flops_weight_terms_equal_the_built_models_matmuls(q_lora_rank, depths):
    cfg = _deepseek(q_lora_rank, depths)
    model = cfg.model.provide_meta()
    assert matmul_terms(cfg.model).weights == _census(model, topk=2, depths=depths or 0)


def test_dense_gqa_flops_weight_terms_equal_the_built_models_matmuls():
    cfg = _dense_gqa()
    assert matmul_terms(cfg.model).weights == _census(cfg.model.provide_meta(), topk=1, depths=0)


# ------------------------------------------------------------------------------------------ PEFT

def test_lora_flops_equal_the_hand_count():
    """Frozen base: 4 FLOPs per weight and token (forward, input gradient), attention core as in full training,
    adapters 6 per adapter weight and token. LoRA rank 4 on q/k/v of both layers (one A shared by the fused
    group) and on layer 1's linear_fc2 only: layer 0's MLP and both output projections stay unadapted."""
    cfg = _dense_gqa()
    cfg.peft = LoRA(dim=4, alpha=8, target_modules=["linear_qkv", "decoder.layers.1.mlp.linear_fc2"])
    h, q, k, f, V, r, layers = 64, 64, 32, 128, 256, 4, 2
    base = layers * (h * q + 2 * h * k + q * h + 3 * h * f) + h * V  # q, k, v, proj, gate/up/down; logits
    qkv_adapter = r * h + r * (q + k + k)  # A [r, h] once, B rows for q, k and v
    fc2_adapter = r * f + r * h
    adapters = layers * qkv_adapter + fc2_adapter
    assert adapter_multiply_adds_per_token(cfg.model, cfg.peft) == adapters == 2304
    tokens = BATCH * 32
    core = 6 * layers * (2 * q / 2) * tokens * 32  # Q.K^T and P.V over q channels, causal half
    assert num_floating_point_operations(cfg, BATCH) == 4 * base * tokens + core + 6 * adapters * tokens
    full = num_floating_point_operations(_dense_gqa(), BATCH)
    assert full == 6 * base * tokens + core


def test_lora_flops_count_expert_adapters_top_k_times():
    """Adapters on MLA's projections and on every expert: a token runs through the adapters of its top-2 routed
    experts, the shared expert's and the dense layer's; the count equals the adapters built on the model."""
    cfg = _deepseek(q_lora_rank=64, mtp_num_layers=1)
    cfg.peft = LoRA(dim=4, target_modules=["linear_q_down_proj", "linear_kv_up_proj", "linear_fc1", "linear_fc2"])
    r, h, q_rank, kv_rank, heads = 4, 128, 64, 32, 8
    attention = r * (h + q_rank) + r * (kv_rank + heads * (16 + 16))  # q_down, kv_up
    dense = r * (h + 2 * 512) + r * (512 + h)  # fc1 (A shared by gate and up), fc2
    expert = r * (h + 2 * 128) + r * (128 + h)  # one expert's fc1 + fc2 adapters; shared expert the same shape
    moe = 2 * expert + expert  # two routed experts and the shared expert
    expected = 5 * attention + dense + 4 * moe  # 4 decoder layers and the MTP depth's (MoE) layer
    assert adapter_multiply_adds_per_token(cfg.model, cfg.peft) == expected
    model = cfg.model.provide_meta()
    apply_adapters(model, cfg.peft)
    built = sum(p.numel() * (2 / 8 if ".experts." in n else 1) for n, p in model.named_parameters()
                if ".adapter." in n)
    assert built == expected
