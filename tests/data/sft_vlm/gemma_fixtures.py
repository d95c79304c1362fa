"""A tiny Gemma 3 vision-language model directory for the multimodal SFT tests: the conversion tests' random
Gemma3ForConditionalGeneration and processor (tests/conversion/gemma_vlm_models.py) with a chat template its tiny tokenizer
can split into turns, and colour questions in words of its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.data.sft_vlm.conftest import colour_rows


def gemma_chat_template(marked: bool = False) -> str:
    """A Gemma-like chat template for the tiny tokenizer (which has no turn markers): each turn is its parts
    closed by ``<eos>``; ``marked`` wraps the assistant's turns in generation markers (the HF oracle's
    assistant mask)."""
    body = ("{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image>{% else %}{{ c['text'] }}"
            "{% endif %}{% endfor %}{{ eos_token }}")
    if marked:
        body = ("{% if m['role'] == 'assistant' %}{% generation %}" + body + "{% endgeneration %}{% else %}"
                + body + "{% endif %}")
    return "{{ bos_token }}{% for m in messages %}" + body + "{% endfor %}"


def make_gemma_vl_dir(directory: Path, **config_kwargs: Any) -> Path:
    """A random tiny Gemma 3 VL HF directory (weights, processor, ``gemma_chat_template``)."""
    from tests.conversion.gemma_vlm_models import make_gemma3_vlm

    directory.mkdir(parents=True, exist_ok=True)
    make_gemma3_vlm(directory, **config_kwargs)
    (directory / "chat_template.jinja").write_text(gemma_chat_template())
    return directory


# Each turn is its parts closed by <eos> (the tiny tokenizer has no turn markers); an image is Gemma 4's <|image|>.
GEMMA4_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% for c in m['content'] %}"
                        "{% if c['type'] == 'image' %}<|image|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
                        "{{ eos_token }}{% endfor %}")


def make_gemma4_vl_dir(directory: Path) -> Path:
    """A random tiny Gemma 4 VL HF directory (one encoder layer, word embeddings of std 0.5 so that a finetune
    moves the logits; the processor with ``GEMMA4_CHAT_TEMPLATE``)."""
    from tests.conversion.gemma4_vlm_models import make_gemma4_vlm

    directory.mkdir(parents=True, exist_ok=True)
    make_gemma4_vlm(directory, vision_layers=1, embedding_std=0.5)
    (directory / "chat_template.jinja").write_text(GEMMA4_CHAT_TEMPLATE)
    return directory


def gemma_colour_rows(root: str, n: int, seed: int = 0, text_only_every: int = 0) -> list[dict[str, Any]]:
    """``colour_rows`` asked as "the picture" (words the tiny tokenizer knows); with
    ``text_only_every=k`` every k-th conversation has no image."""
    rows = colour_rows(root, n, seed=seed)
    for i, row in enumerate(rows):
        question = row["messages"][0]["content"]
        question[1]["text"] = "the picture"
        if text_only_every and i % text_only_every == text_only_every - 1:
            del question[0]
            question[0]["text"] = "the quick brown fox"
        row["messages"][2:] = []
    return rows
