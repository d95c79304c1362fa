"""A tiny random GLM-4.5 MoE (``Glm4MoeForCausalLM``) saved with ``save_pretrained``: partial RoPE, q/k/v biases,
QK-norm, a dense first layer, two expert groups, a shared expert and random non-zero routing biases
(``e_score_correction_bias``) large enough that a model ignoring them routes differently."""

from __future__ import annotations

import torch
import transformers

from tests.conversion.hf_models import VOCAB, make_tokenizer

GLM_SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, n_routed_experts=8,
                 num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                 attention_bias=True, use_qk_norm=True, routed_scaling_factor=2.5, max_position_embeddings=64,
                 tie_word_embeddings=False, attention_dropout=0.0, eos_token_id=1, pad_token_id=2,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def glm_config(**overrides) -> transformers.Glm4MoeConfig:
    return transformers.Glm4MoeConfig(**dict(GLM_SHAPE, **overrides))


def make_glm_model(directory, seed: int = 0, tokenizer: bool = True, dtype=torch.float32, **overrides):
    """Save a random GLM-4.5 MoE to ``directory`` (non-trivial norms, biases, routers, routing biases); returns it."""
    torch.manual_seed(seed)
    model = transformers.Glm4MoeForCausalLM(glm_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.2)
            elif name.endswith("gate.weight"):  # routers: spread the scores so ties never happen
                p.normal_(0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.5, 0.5)
    model = model.to(dtype).eval()
    model.save_pretrained(str(directory))
    if tokenizer:
        make_tokenizer(directory)
    return model
