"""Fixtures of the multimodal SFT data tests: a tiny Qwen2.5-VL-style processor directory built locally (the SFT
tests' BPE tokenizer with the vision special tokens, Qwen2VLImageProcessor with small images, a Qwen-VL chat
template), images drawn with Pillow, and conversations that ask for the colour of a drawn square."""

from __future__ import annotations

import json
import os
import random
from typing import Any, Callable

import pytest

from tests.data.sft.conftest import make_hf_tokenizer_dir
from tests.parallel.conftest import pool2  # noqa: F401

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def _qwen_vl_template(marked: bool) -> str:
    """Qwen2-VL's chat template, shortened; ``marked`` wraps assistant replies in generation markers (the HF
    oracle's assistant mask)."""
    body = ("{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
            "{% endif %}{% endfor %}{% endif %}<|im_end|>\n")
    if marked:
        body = ("{% if message['role'] == 'assistant' %}{% generation %}" + body + "{% endgeneration %}{% else %}"
                + body + "{% endif %}")
    return ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
            "<|im_start|>{{ message['role'] }}\n" + body + "{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_qwen_vl_processor_dir(path: str, marked: bool = False) -> str:
    """A Qwen2.5-VL processor directory (tokenizer, image processor, chat template) made without downloads."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    make_hf_tokenizer_dir(path, chat_template=None)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, temporal_patch_size=2,
                             merge_size=2).save_pretrained(path)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(_qwen_vl_template(marked))
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Qwen2_5_VLProcessor"}, f)
    return path


@pytest.fixture(scope="session")
def vl_processor_dir(tmp_path_factory) -> str:
    return make_qwen_vl_processor_dir(str(tmp_path_factory.mktemp("vl-proc")))


@pytest.fixture(scope="session")
def vl_processor(vl_processor_dir):
    from longspan.data.sft.multimodal import load_processor

    return load_processor(vl_processor_dir)


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
SIZES = [(56, 56), (28, 56), (56, 28), (28, 28)]


def draw_square(path: str, colour: str, size: tuple[int, int]) -> str:
    """A white image of ``size`` (width, height) with a square of ``colour`` in it."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (255, 255, 255))
    w, h = size
    side = min(w, h) // 2
    ImageDraw.Draw(image).rectangle([w // 4, h // 4, w // 4 + side, h // 4 + side], fill=COLOURS[colour])
    image.save(path)
    return path


def colour_rows(root: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` conversations 'what colour is the square?' -> the colour, images of varied sizes under ``root``
    (relative paths); every third conversation has a second exchange without an image."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    rows = []
    for i in range(n):
        colour = rng.choice(sorted(COLOURS))
        name = f"images/{i}.png"
        draw_square(os.path.join(root, name), colour, SIZES[i % len(SIZES)])
        messages = [{"role": "user", "content": [{"type": "image", "image": name},
                                                 {"type": "text", "text": "what colour?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": colour}]}]
        if i % 3 == 2:
            messages += [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
        rows.append({"messages": messages})
    return rows


def qwen_colour_rows(root: str, n: int, seed: int, text_only: Callable[[int], bool] = lambda i: False,
                     text_only_question: str = "what colour") -> list[dict[str, Any]]:
    """``colour_rows`` of one exchange in words of the Qwen-VL model fixtures' tokenizer
    (tests/models/vlm/qwen_vl_fixtures.py); conversation ``i`` asks ``text_only_question`` without an image where
    ``text_only(i)``."""
    rows = colour_rows(root, n, seed=seed)
    for i, row in enumerate(rows):
        row["messages"][0]["content"][1]["text"] = "what colour"
        row["messages"][2:] = []
        if text_only(i):
            row["messages"][0]["content"] = [{"type": "text", "text": text_only_question}]
    return rows


def write_jsonl(path: str, rows: list[Any]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def moe_from_scratch(cfg: Any, hf_dir: Any, expert_parallel: int = 1) -> Any:
    """``cfg`` (a VLM recipe config on ``hf_dir``) made to train from random weights a model of the directory's
    architecture whose language model has 4 routed experts (top 2, load-balancing loss on) in every layer:
    HF has no MoE Qwen2.5-VL or Gemma 3 VL to start from. The tokenizer and image processor stay the
    directory's."""
    import dataclasses

    from longspan.conversion import AutoBridge

    provider = AutoBridge.from_hf_pretrained(hf_dir).to_megatron_provider(load_weights=False)
    cfg.model = dataclasses.replace(
        provider, seq_length=cfg.model.seq_length, tensor_model_parallel_size=cfg.model.tensor_model_parallel_size,
        num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
        expert_model_parallel_size=expert_parallel)
    cfg.checkpoint.pretrained_checkpoint = None
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = str(hf_dir)
    return cfg


def run_counting_sharded_experts(run: Callable[[Any], Any], cfg: Any) -> int:
    """``run(cfg)`` (pretrain or finetune); returns how many expert parameters expert parallel sharded on this
    rank (0 when it left the experts whole), so a parity test knows the layout it compared really split them."""
    import longspan.parallel.parallelize as parallelize

    sharded: list[Any] = []
    original = parallelize.apply_expert_parallel

    def counting(*args: Any, **kwargs: Any) -> list[Any]:
        params = original(*args, **kwargs)
        sharded.extend(params)
        return params

    parallelize.apply_expert_parallel = counting
    try:
        run(cfg)
    finally:
        parallelize.apply_expert_parallel = original
    return len(sharded)


def pretrain_counting_sharded_experts(cfg: Any) -> int:
    """``pretrain(cfg)`` through ``run_counting_sharded_experts``."""
    from longspan.training.pretrain import pretrain

    return run_counting_sharded_experts(pretrain, cfg)
