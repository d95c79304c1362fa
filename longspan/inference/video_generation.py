"""Prompts with videos for a vision-language model whose HF processor has a video path in longspan
(a family's preprocessing registered in ``longspan.data.sft.video``): ``video_prompt_inputs`` reads the videos
(a file, decoded through PyAV, or a directory of frame images taken at a given rate), runs the model
directory's HF processor with the family's video preprocessing (the processor writes each temporal patch's
timestamp and tokens into the prompt) and gives the prompt's ids and the model's inputs
(``pixel_values_videos``, ``video_grid_thw``, and the images' when there are any), what
``generate(..., model_inputs=...)`` takes (``longspan generate --video``).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Optional, Sequence

import torch
from torch import nn

from longspan.core.errors import CheckpointError, ConfigError, NotSupportedError
from longspan.data.sft.multimodal import has_image_processor, load_processor
from longspan.data.sft.video import read_video, video_preprocessor

#: processor outputs the model does not take (the ids go positionally; one prompt has no padding)
_NOT_MODEL_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids")


def check_video_model(net: nn.Module, context: str) -> None:
    """One-line NotSupportedError (starting with ``context``) when ``net``'s forward takes no videos."""
    if "pixel_values_videos" not in inspect.signature(net.forward).parameters:
        raise NotSupportedError(f"{context}: {type(net).__name__} has no video path; drop --video")


def video_processor_of(processor_dirs: Sequence[str | os.PathLike]) -> Any:
    """The HF processor, with its video preprocessing, of the first of ``processor_dirs`` whose processor has a
    video path; one-line CheckpointError when none has."""
    for directory in processor_dirs:
        if not has_image_processor(str(directory)):  # the processors with a video path have an image processor
            continue
        processor = load_processor(str(directory), field=f"processor of {directory}")
        if video_preprocessor(processor) is not None:
            return processor
    raise CheckpointError(f"no HF processor with a video path in {', '.join(str(d) for d in processor_dirs)}: videos "
                          "need the model's processor files (tokenizer, image processor, config.json)")


def video_prompt_inputs(processor: Any, prompt: str, videos: Sequence[str | os.PathLike],
                        fps: Optional[float] = None,
                        images: Sequence[Any] = ()) -> tuple[list[int], dict[str, torch.Tensor]]:
    """(prompt ids with each video's timestamps and tokens, the model's video and image inputs). ``videos``: video
    files or directories of frame images (taken at ``fps`` per second); the prompt's ``<|video_pad|>`` (and
    image) markers say where each goes, else they go in front, each between ``<|vision_start|>`` and
    ``<|vision_end|>``. ``images``: opened images."""
    pre = video_preprocessor(processor)
    clips = [read_video(str(v), fps, pre, f"--video {v}") for v in videos]
    start, end = (getattr(processor, name, None) or default for name, default in
                  (("vision_start_token", "<|vision_start|>"), ("vision_end_token", "<|vision_end|>")))
    front = ""
    if images and processor.image_token not in prompt:
        front += f"{start}{processor.image_token}{end}" * len(images)
    if processor.video_token not in prompt:
        front += f"{start}{processor.video_token}{end}" * len(clips)
    try:
        out = processor(text=front + prompt, images=list(images) or None, videos=[c for c, _ in clips],
                        video_metadata=[m for _, m in clips], return_tensors="pt")
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(f"--prompt: the processor refused the prompt with {len(clips)} video(s): {first}") from None
    return out["input_ids"][0].tolist(), {k: v for k, v in out.items() if k not in _NOT_MODEL_INPUTS}


__all__ = ["check_video_model", "video_processor_of", "video_prompt_inputs"]
