"""A tiny random Qwen3-VL or Qwen3.5 with images (dense, or with experts) saved as an HF model directory with the
Qwen2.5-VL fixtures' tokenizer and chat template and an image processor of 16-pixel patches: the oracle of the
Qwen3-VL and Qwen3.5-VL tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.models.vlm.qwen_vl_fixtures import VOCAB, make_tokenizer, save_processor_files, special_token_ids

PROMPT = ("describe <|vision_start|> <|image_pad|> <|vision_end|> and <|vision_start|> <|image_pad|> "
          "<|vision_end|> what colour")


def hf_config(moe: bool = False) -> transformers.PretrainedConfig:
    tok = make_tokenizer()
    special = special_token_ids(tok)
    # head_dim 16: 8 frequency pairs, interleaved T H W T H W T T (sections 4, 2, 2)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True},
                eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id)
    # a 5x5 learned position grid resampled to 4x4 and 2x6 patch grids; DeepStack from blocks 0 and 2
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=25,
                  deepstack_visual_indexes=[0, 2])
    if moe:  # 4 experts of which 2 per token, layer 1 dense
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                    mlp_only_layers=[1])
        return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **special)
    return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **special)


def image_processor() -> transformers.Qwen2VLImageProcessor:
    """Patches of 16 pixels, 2x2 merge: small images kept at their size (multiples of 32)."""
    return transformers.Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                                              size={"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 16})


def make_qwen3_vl(directory: Path, moe: bool = False, seed: int = 0) -> transformers.PreTrainedModel:
    """Save a random Qwen3-VL (non-trivial norms and biases) with its tokenizer, image processor and chat
    template; returns the transformers model (fp32, eval)."""
    torch.manual_seed(seed)
    cls = transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    hf = cls(hf_config(moe))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.2)
            else:
                p.normal_(0, 0.3)
    hf = hf.eval()
    hf.save_pretrained(str(directory))
    save_processor_files(directory, make_tokenizer(), image_processor())
    return hf


def make_qwen35_vl(directory: Path, moe: bool = False) -> transformers.PreTrainedModel:
    """Save a random Qwen3.5 with images (a DeltaNet layer and a gated-attention layer; half of each 16-channel
    head rotates: 4 frequency pairs T H W T; with ``moe``, 4 experts and a shared one on both layers) with the
    tokenizer, image processor and chat template; returns the transformers model (fp32, eval)."""
    tok = make_tokenizer()
    special = special_token_ids(tok)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=3,
                layer_types=["linear_attention", "full_attention"], max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=25)
    if moe:
        text.pop("intermediate_size")
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20)
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **special)
        hf = transformers.Qwen3_5MoeForConditionalGeneration(config)
    else:
        config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, **special)
        hf = transformers.Qwen3_5ForConditionalGeneration(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # the (1 + w) norms of the language model, the encoder's plain LayerNorms
                p.copy_(torch.empty(p.shape).uniform_(-0.4, 0.4, generator=g) + (0.0 if "language" in name else 1.0))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    hf = hf.float().eval()
    hf.save_pretrained(str(directory))
    save_processor_files(directory, tok, image_processor())
    return hf
