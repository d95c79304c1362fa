"""A tiny random Qwen2.5-VL saved as an HF model directory (weights, config.json, tokenizer, image processor,
chat template), and small images drawn with Pillow: the oracle of the Qwen2.5-VL tests. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers

WORDS = ("a an the cat dog red blue green square circle picture image of is and left right top bottom what "
         "describe colour shape big small two one").split()
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
           "<|image_pad|>", "<|video_pad|>")
VOCAB = 80  # the model's; the tokenizer uses fewer ids (not a multiple of 128: kept unpadded)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
                 "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}"
                 "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer with Qwen2.5-VL's special tokens (ids: words first, then the specials)."""
    vocab = {w: i for i, w in enumerate(("<unk>", *WORDS))}
    ids = {tok: len(vocab) + i for i, tok in enumerate(SPECIAL)}
    tok = Tokenizer(models.WordLevel(vocab={**vocab, **ids}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", additional_special_tokens=list(SPECIAL))
    fast.chat_template = CHAT_TEMPLATE
    return fast


def special_token_ids(tok: transformers.PreTrainedTokenizerFast) -> dict[str, int]:
    """The config's image, video and vision-delimiter token ids in ``tok``."""
    return {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}


def save_processor_files(directory: Path, tok: transformers.PreTrainedTokenizerFast,
                         images: transformers.Qwen2VLImageProcessor) -> None:
    """The tokenizer, the image processor and the chat template beside a saved model."""
    tok.save_pretrained(str(directory))
    images.save_pretrained(str(directory))
    (Path(directory) / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def image_processor() -> transformers.Qwen2VLImageProcessor:
    """Patches of 14 pixels, 2x2 merge, small images kept at their size (multiples of 28)."""
    return transformers.Qwen2VLImageProcessor(size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16})


def hf_config(tie: bool = False, text_layers: int = 2) -> transformers.Qwen2_5_VLConfig:
    tok = make_tokenizer()
    special = special_token_ids(tok)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=text_layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie,
                                         eos_token_id=tok.eos_token_id, **special)


def make_qwen_vl(directory: Path, seed: int = 0, tie: bool = False, dtype: torch.dtype = torch.float32,
                 text_layers: int = 2) -> transformers.Qwen2_5_VLForConditionalGeneration:
    """Save a random Qwen2.5-VL (non-trivial norms and biases, ``text_layers`` decoder layers) with its tokenizer
    and image processor."""
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(hf_config(tie, text_layers))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.2)
            else:
                p.normal_(0, 0.3)  # large enough that images and positions move the logits
    model = model.to(dtype).eval()
    model.save_pretrained(str(directory))
    save_processor_files(directory, make_tokenizer(), image_processor())
    return model


def draw_image(width: int, height: int, seed: int) -> Image.Image:
    """A random RGB picture of ``width`` x ``height`` pixels."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def processed(directory: Path, prompt: str, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """The HF processor's outputs for ``prompt`` (each ``<|image_pad|>`` expanded to its image's tokens)."""
    processor = transformers.Qwen2VLImageProcessor.from_pretrained(str(directory))
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    pix = processor(images=images, return_tensors="pt")
    grid = pix["image_grid_thw"]
    parts = prompt.split("<|image_pad|>")
    text = parts[0]
    for i, part in enumerate(parts[1:]):
        text += " " + " ".join(["<|image_pad|>"] * int(grid[i].prod() // 4)) + " " + part
    ids = torch.tensor([tok(text)["input_ids"]])
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    return {"input_ids": ids, "pixel_values": pix["pixel_values"], "image_grid_thw": grid,
            "mm_token_type_ids": (ids == image_id).int()}


def image_inputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The image inputs of ``processed``'s outputs that longspan's model takes beside the token ids."""
    return {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}


def assert_logits_equal_transformers(hf: torch.nn.Module, model: torch.nn.Module, inputs: dict[str, torch.Tensor],
                                     atol: float) -> None:
    """longspan's logits on ``processed``'s outputs equal transformers' to ``atol``, and other pixels (the
    patches reversed) move them: the images do reach the logits."""
    with torch.no_grad():
        expected = hf(**inputs).logits
        ours = model(inputs["input_ids"], **image_inputs(inputs))
        other_pixels = model(inputs["input_ids"], pixel_values=inputs["pixel_values"].flip(0),
                             image_grid_thw=inputs["image_grid_thw"])
    torch.testing.assert_close(ours, expected, rtol=0, atol=atol)
    assert (other_pixels - ours).abs().max() > 1e-2
