"""A tiny random Gemma 3 vision-language model (Gemma3ForConditionalGeneration) with its processor (Gemma 3's
image processor, a tiny BPE tokenizer with the image tokens, a chat template), saved locally; images drawn with
Pillow. Nothing is downloaded."""

from __future__ import annotations

import torch
import transformers
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

VOCAB = 96
IMAGE_SIZE = 28  # 2 x 2 patches of 14 pixels
TOKENS_PER_IMAGE = 4  # avg-pool kernel 1: every patch is a token (a kernel of 2 is tested with one token per image)
WINDOW = 6  # shorter than the prompts (two images of 4 tokens with their delimiters), longer than one image
SPECIAL = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
CHAT_TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% for c in m['content'] %}"
                 "{% if c['type'] == 'image' %}<start_of_image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
                 "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def tiny_bpe_tokenizer(vocab: int, specials: list[str],
                       extra_special_tokens: dict[str, str]) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here on two sentences, with ``specials`` first (``<unk>``, ``<eos>``,
    ``<pad>`` and ``<bos>`` among them) and at most ``vocab`` ids."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab - 4, special_tokens=specials,
                                  initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet())[:60])
    text = ["describe the picture: a red square and a blue dot", "the quick brown fox jumps over the lazy dog"] * 20
    tok.train_from_iterator(text, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                                pad_token="<pad>", bos_token="<bos>",
                                                extra_special_tokens=extra_special_tokens)
    assert len(fast) <= vocab
    return fast


def make_processor(directory, tokens_per_image: int = TOKENS_PER_IMAGE):
    """Gemma3Processor (image processor + tokenizer + chat template) saved to ``directory``; returns it."""
    fast = tiny_bpe_tokenizer(VOCAB, ["<unk>", "<eos>", "<pad>", "<bos>", *SPECIAL.values()], SPECIAL)
    images = transformers.Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.Gemma3Processor(images, fast, chat_template=CHAT_TEMPLATE,
                                             image_seq_length=tokens_per_image)
    processor.save_pretrained(str(directory))
    return processor


def gemma3_vlm_config(tokenizer, window: int = WINDOW, tokens_per_image: int = TOKENS_PER_IMAGE,
                      vision_layers: int = 1, image_size: int = IMAGE_SIZE):
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128, sliding_window=window,
                query_pre_attn_scalar=8, rope_parameters=rope, layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=vision_layers, num_attention_heads=2,
                  image_size=image_size, patch_size=14, vision_use_head=False)
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in SPECIAL.items()}
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=tokens_per_image,
                                     image_token_index=ids["image_token"], boi_token_index=ids["boi_token"],
                                     eoi_token_index=ids["eoi_token"])


def make_gemma3_vlm(directory, seed: int = 0, **config_kwargs):
    """Save a random Gemma3ForConditionalGeneration (norm weights away from their init) and its processor to
    ``directory``; returns (model, processor)."""
    tokens = config_kwargs.get("tokens_per_image", TOKENS_PER_IMAGE)
    processor = make_processor(directory, tokens)
    cfg = gemma3_vlm_config(processor.tokenizer, **config_kwargs)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
            elif "mm_input_projection" in name:
                p.normal_(0, 0.3)
    model = model.eval()
    model.config._attn_implementation = "eager"
    model.config.text_config._attn_implementation = "eager"
    model.save_pretrained(str(directory))
    return model, processor


def draw_image(kind: int, size: int = 64) -> Image.Image:
    """A small RGB picture (one of a few shapes and colours)."""
    image = Image.new("RGB", (size, size), ((40 * kind) % 256, 200, 90))
    draw = ImageDraw.Draw(image)
    colour = [(230, 20, 20), (20, 20, 230), (250, 250, 0)][kind % 3]
    if kind % 2:
        draw.ellipse((8, 8, size - 12, size - 20), fill=colour)
    else:
        draw.rectangle((4, 10, size // 2, size - 6), fill=colour)
    return image
