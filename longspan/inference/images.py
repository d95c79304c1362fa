"""Images for a vision-language model's prompt: read the files (``load_images``, the one reader every image
prompt uses), and, for Qwen2.5-VL, run the model directory's HF image processor and give each image its tokens
in the prompt (``longspan.inference.image_generation.image_prompt_inputs`` picks this path or the HF processor's
by model).

Qwen2.5-VL: the prompt's ``<|image_pad|>`` tokens (the model's ``image_token_id``) mark where the images go, one per image,
in order; a prompt without any gets each image in front, as ``<|vision_start|><|image_pad|><|vision_end|>``.
Each mark then becomes one image token per merged patch of its image (what the HF processor does to the text).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

from longspan.core.errors import CheckpointError, DataError
from longspan.models.vlm.mrope import image_token_count

PROCESSOR_FILE = "preprocessor_config.json"


def load_images(images: Sequence[Any]) -> list[Any]:
    """RGB ``PIL.Image``s of ``images`` (paths, or PIL images kept as they are); a missing or unreadable file is
    a one-line ``DataError`` naming it."""
    from PIL import Image, UnidentifiedImageError  # optional dependency: only prompts with images need Pillow

    out = []
    for item in images:
        if not isinstance(item, (str, os.PathLike)):
            out.append(item)
            continue
        path = Path(item)
        if not path.is_file():
            raise DataError(f"image {path} does not exist (no such file): give the path of an image file")
        try:
            with Image.open(path) as opened:
                out.append(opened.convert("RGB"))
        except (UnidentifiedImageError, OSError) as exc:
            raise DataError(f"image {path} cannot be read as an image ({type(exc).__name__}): not a readable "
                            "image; give a PNG, JPEG or another format Pillow reads") from None
    return out


def load_image_processor(directory: str | os.PathLike) -> Any:
    """The HF image processor saved in ``directory`` (its preprocessor_config.json); one-line error if none."""
    path = Path(directory) / PROCESSOR_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {PROCESSOR_FILE}: images need the model's image processor")
    import transformers  # optional dependency: only prompts with images need the HF image processor

    return transformers.AutoImageProcessor.from_pretrained(str(directory))


def process_images(processor: Any, images: Sequence[Any]) -> dict[str, torch.Tensor]:
    """``pixel_values`` and ``image_grid_thw`` of ``images`` (the processor's names)."""
    out = processor(images=list(images), return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def expand_image_tokens(prompt_ids: Sequence[int], image_grid_thw: torch.Tensor, config: Any) -> list[int]:
    """``prompt_ids`` with each image mark (``config.image_token_id``) repeated once per merged patch of its
    image (``config``: a ``Qwen25VLModelProvider``); marks added in front when the prompt has none. A count
    of marks other than the number of images is a one-line ``DataError``."""
    image_id = int(config.image_token_id)
    merge = int(config.vision_config.get("spatial_merge_size", 2))
    grids = image_grid_thw.tolist()
    ids = [int(i) for i in prompt_ids]
    marks = sum(1 for i in ids if i == image_id)
    if marks == 0:
        front = [int(config.vision_start_token_id), image_id, int(config.vision_end_token_id)]
        ids = front * len(grids) + ids
    elif marks != len(grids):
        raise DataError(f"the prompt has {marks} image tokens (<|image_pad|>) for {len(grids)} images: "
                        "put one per image, or none to have the images put in front")
    out, image = [], 0
    for token in ids:
        if token == image_id:
            out += [image_id] * image_token_count(grids[image], merge)
            image += 1
        else:
            out.append(token)
    return out
