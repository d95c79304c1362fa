"""A tiny random Gemma 4 vision-language model (Gemma4ForConditionalGeneration) with its processor (Gemma 4's
image processor, a tiny BPE tokenizer with the image and audio tokens, a chat template), saved locally. Nothing is
downloaded. Without torchvision transformers cannot build Gemma 4's video processor: the processor is made
without it, as longspan loads such a directory (``longspan.data.sft.multimodal.load_processor``)."""

from __future__ import annotations

import torch
import transformers
from longspan.data.sft.multimodal import image_only_processor_class
from tests.conversion.gemma_vlm_models import tiny_bpe_tokenizer

VOCAB = 128
PATCH, KERNEL = 4, 2  # 4-pixel patches, pooled 2 x 2 into one soft token
MAX_SOFT_TOKENS = 70  # the smallest budget Gemma 4's image processor takes: at most 280 patches per image
SPECIAL = {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>",
           "boa_token": "<|audio>", "audio_token": "<|audio|>", "eoa_token": "<audio|>"}
CHAT_TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% for c in m['content'] %}"
                 "{% if c['type'] == 'image' %}<|image|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
                 "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def make_processor(directory):
    """Gemma4Processor (image processor, audio feature extractor, tokenizer, chat template; no video processor)
    saved to ``directory``; returns it."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", *SPECIAL.values(),
                "<|video|>"]
    fast = tiny_bpe_tokenizer(VOCAB, specials, SPECIAL)
    images = transformers.Gemma4ImageProcessorPil(patch_size=PATCH, max_soft_tokens=MAX_SOFT_TOKENS,
                                                  pooling_kernel_size=KERNEL)
    cls = image_only_processor_class(transformers.Gemma4Processor)
    processor = cls(feature_extractor=transformers.Gemma4AudioFeatureExtractor(), image_processor=images,
                    tokenizer=fast, chat_template=CHAT_TEMPLATE, image_seq_length=MAX_SOFT_TOKENS)
    processor.save_pretrained(str(directory))
    return processor


def gemma4_vlm_config(tokenizer, bidirectional: str | None = None, vision_layers: int = 2):
    """Text: a sliding-window layer and a full one (their own head widths), per-layer inputs, soft-capped logits;
    vision: clipped linears and standardized outputs (every buffer of the encoder in use)."""
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=24,
                layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=VOCAB, final_logit_softcapping=30.0, max_position_embeddings=512,
                use_bidirectional_attention=bidirectional, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=vision_layers, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=PATCH, pooling_kernel_size=KERNEL,
                  position_embedding_size=64, use_clipped_linears=True, standardize=True,
                  rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in SPECIAL.items()}
    return transformers.Gemma4Config(text_config=text, vision_config=vision, image_token_id=ids["image_token"],
                                     boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"],
                                     audio_token_id=ids["audio_token"], boa_token_id=ids["boa_token"],
                                     eoa_token_index=ids["eoa_token"],
                                     video_token_id=tokenizer.convert_tokens_to_ids("<|video|>"))


def make_gemma4_vlm(directory, seed: int = 0, embedding_std: float = 0.02, **config_kwargs):
    """Save a random Gemma4ForConditionalGeneration (norms, clips and standardization away from their init) and
    its processor to ``directory``; returns (model, processor). ``embedding_std``: of the (tied) word embeddings,
    whose size bounds the logits behind the final norm (a finetune needs more than the init's 0.02)."""
    processor = make_processor(directory)
    cfg = gemma4_vlm_config(processor.tokenizer, **config_kwargs)
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "embedding_projection" in name or "position_embedding_table" in name:
                p.normal_(0, 0.3)
            elif name.endswith("language_model.embed_tokens.weight"):
                p.normal_(0, embedding_std)
        for name, b in model.named_buffers():
            if name.endswith(("input_min", "output_min")):
                b.fill_(-2.0)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(2.0)
            elif name.endswith("std_bias"):
                b.normal_(0, 0.5)
            elif name.endswith("std_scale"):
                b.uniform_(0.5, 1.5)
            elif name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    model = model.eval()
    model.config._attn_implementation = "eager"
    model.config.text_config._attn_implementation = "eager"
    model.config.vision_config._attn_implementation = "eager"
    model.save_pretrained(str(directory))
    return model, processor
