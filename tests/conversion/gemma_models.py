"""Tiny random Gemma 2, Gemma 3 (text and vision-language) and OLMo-2 models saved with ``save_pretrained``."""

from __future__ import annotations

import torch
import transformers

from tests.conversion.hf_models import VOCAB, make_tokenizer

GEMMA_FAMILIES = ("gemma2", "gemma3", "gemma3_vlm", "olmo2")
WINDOW = 5  # prompts in the tests are longer, so a model ignoring the window would differ

_SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attention_dropout=0.0)


def gemma_config(family: str, window: int = WINDOW, **overrides):
    if family == "gemma2":
        cfg = transformers.Gemma2Config(**_SHAPE, sliding_window=window, query_pre_attn_scalar=12,
                                        attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif family in ("gemma3", "gemma3_vlm"):
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
        text = dict(_SHAPE, sliding_window=window, query_pre_attn_scalar=8, rope_parameters=rope,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
        if family == "gemma3":
            cfg = transformers.Gemma3TextConfig(**text)
        else:
            vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          image_size=28, patch_size=14, vision_use_head=False)
            cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                            image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2,
                                            eoi_token_index=VOCAB - 3)
    elif family == "olmo2":
        shape = {k: v for k, v in _SHAPE.items() if k != "head_dim"}
        cfg = transformers.Olmo2Config(**shape, tie_word_embeddings=False, pad_token_id=2, eos_token_id=1,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg.text_config if family == "gemma3_vlm" else cfg, key, value)
    return cfg


def model_class(family: str):
    return {"gemma2": transformers.Gemma2ForCausalLM, "gemma3": transformers.Gemma3ForCausalLM,
            "gemma3_vlm": transformers.Gemma3ForConditionalGeneration,
            "olmo2": transformers.Olmo2ForCausalLM}[family]


def make_gemma_model(family: str, directory, dtype=torch.float32, tokenizer: bool = True, seed: int = 0,
                     **overrides):
    """Save a random ``family`` model (norm weights away from their init) to ``directory``; returns it."""
    cfg = gemma_config(family, **overrides)
    torch.manual_seed(seed)
    model = model_class(family)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if family != "olmo2" else p.uniform_(0.5, 1.5)
    model = model.to(dtype).eval()
    model.save_pretrained(str(directory))
    if tokenizer:
        make_tokenizer(directory)
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    model.config._attn_implementation = "eager"
    if hasattr(model.config, "text_config"):
        model.config.text_config._attn_implementation = "eager"
    with torch.no_grad():
        return model(input_ids=tokens).logits
