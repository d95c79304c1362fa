"""Qwen3-VL's video preprocessing (also Qwen3.5's: both use ``Qwen3VLProcessor``) in numpy, Pillow and torch:
transformers' ``Qwen3VLVideoProcessor`` needs torchvision, which cannot be installed beside every torch build.

``Qwen3VLVideoPreprocessor`` reads the model directory's video processor settings (video_preprocessor_config.json,
or the ``video_processor`` entry of processor_config.json) and does what transformers' does with them:

- ``frame_indices``: a decoded video of ``total`` frames at ``fps`` keeps ``int(total / fps * self.fps)`` frames
  (clamped to ``[min_frames, max_frames]`` and to ``total``), spread evenly from the first to the last
  (``np.linspace(...).round()``);
- ``__call__``: every frame resized (bicubic) to the ``smart_resize`` grid of the whole clip (sides multiples of
  ``patch_size * merge_size``, the clip's pixels within ``size``), rescaled, normalized, then cut into patches of
  ``temporal_patch_size`` frames x ``patch_size``^2 pixels in the merger's order; ``video_grid_thw`` is
  ``(frames / temporal_patch_size, height / patch_size, width / patch_size)``.

The prompt's part (each temporal patch as ``<t seconds>`` and ``<|vision_start|>``, one ``<|video_pad|>`` per
merged patch, ``<|vision_end|>``) is written by transformers' ``Qwen3VLProcessor`` itself from this object's
outputs (``video_metadata``: the source fps and the kept frame indices) and ``merge_size`` /
``temporal_patch_size``.

Two cases are refused where transformers would change the clip silently: frames given as a list whose count the
temporal patch does not divide (transformers repeats the last frame; a decoded video's sampled frames are
completed that way, as transformers does) and frames smaller than one merged patch on a side
(transformers scales them up).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from longspan.core.errors import ConfigError, DataError

#: settings of transformers' Qwen3-VL video processor that are bookkeeping (class names, formats the frames
#: here never use) and leave the outputs as they are
_INERT_KEYS = {"processor_class", "video_processor_type", "image_processor_type", "data_format", "input_data_format",
               "default_to_square", "device", "return_metadata", "video_metadata", "do_convert_rgb", "max_image_size",
               "max_duration", "return_tensors", "crop_size", "_processor_class"}
_RESAMPLE_BICUBIC = 3  # PIL's and transformers' PILImageResampling.BICUBIC


def smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """The (height, width) a clip of ``num_frames`` frames is resized to: sides rounded to multiples of
    ``factor``, scaled down (or up) so the clip's pixels (frames rounded to ``temporal_factor``) stay within
    ``[min_pixels, max_pixels]``, as transformers' Qwen3-VL video processor computes it."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise DataError(f"a video frame of {width}x{height} pixels: the aspect ratio must be below 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass
class Qwen3VLVideoPreprocessor:
    """Qwen3-VL's video processor settings (transformers' names and defaults)."""

    size: dict[str, int]
    """``shortest_edge``: the fewest pixels of a whole clip; ``longest_edge``: the most."""
    patch_size: int = 16
    """Pixels per patch side."""
    temporal_patch_size: int = 2
    """Frames per patch; it must divide the clip's frame count."""
    merge_size: int = 2
    """Patches per merged patch side (one LM token per merge_size^2 patches of a frame pair)."""
    fps: float = 2.0
    """Frames kept per second of a decoded video."""
    min_frames: int = 4
    """The fewest frames kept from a decoded video (at most its frame count)."""
    max_frames: int = 768
    """The most frames kept from a decoded video."""
    do_sample_frames: bool = True
    """Keep ``fps`` frames per second of a decoded video; False: every frame."""
    do_resize: bool = True
    """Resize frames to the ``smart_resize`` grid; False: they must already be multiples of a merged patch."""
    do_rescale: bool = True
    """Multiply pixel values by ``rescale_factor``."""
    rescale_factor: float = 1 / 255
    """The rescale factor."""
    do_normalize: bool = True
    """Subtract ``image_mean`` and divide by ``image_std`` per channel."""
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    """Per-channel mean."""
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    """Per-channel standard deviation."""
    cap_pixels_per_frame: bool = False
    """Cap each frame's pixels at ``max_video_tokens`` merged patches or the budget's share per frame."""
    max_video_tokens: int = 768
    """Merged patches per frame under ``cap_pixels_per_frame``."""

    @classmethod
    def from_settings(cls, settings: dict[str, Any], source: str) -> "Qwen3VLVideoPreprocessor":
        """From transformers' saved settings; a setting this preprocessing does not act on is a one-line
        ConfigError naming ``source``."""
        known = set(cls.__dataclass_fields__)
        kwargs: dict[str, Any] = {}
        for key, value in settings.items():
            unset = value is None or value is False
            if key in _INERT_KEYS or unset and key in ("num_frames", "do_center_crop", "do_pad"):
                continue
            if key == "resample" and value == _RESAMPLE_BICUBIC:
                continue
            if key not in known:
                raise ConfigError(f"{source}: video processor setting {key}={value!r} is not supported yet "
                                  f"(longspan's Qwen3-VL video preprocessing acts on {', '.join(sorted(known))})")
            kwargs[key] = tuple(value) if key in ("image_mean", "image_std") else value
        kwargs.setdefault("size", {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768})
        if not {"shortest_edge", "longest_edge"} <= set(kwargs["size"]):
            raise ConfigError(f"{source}: video processor size={kwargs['size']!r} needs shortest_edge and longest_edge")
        return cls(**kwargs)

    @classmethod
    def from_directory(cls, path: str) -> Optional["Qwen3VLVideoPreprocessor"]:
        """The settings saved in model directory ``path``; the class's defaults (transformers') when the
        directory saves no video processor."""
        single = os.path.join(path, "video_preprocessor_config.json")
        combined = os.path.join(path, "processor_config.json")
        if os.path.isfile(single):
            with open(single) as f:
                return cls.from_settings(json.load(f), single)
        if os.path.isfile(combined):
            with open(combined) as f:
                saved = json.load(f).get("video_processor")
            if isinstance(saved, dict):
                return cls.from_settings(saved, combined)
        return cls.from_settings({}, path)

    def frame_indices(self, total: int, fps: float) -> list[int]:
        """Indices of the frames kept from a decoded video of ``total`` frames taken at ``fps``."""
        if not self.do_sample_frames:
            indices = list(range(total))
        else:
            count = int(total / fps * self.fps)
            count = min(max(count, self.min_frames), self.max_frames, total)
            indices = np.linspace(0, total - 1, count).round().astype(int).tolist()
        # transformers repeats a sampled clip's last frame up to whole temporal patches (and numbers the
        # timestamps with the repeat): the same frames, so a decoded video of any length is served
        return indices + indices[-1:] * (-len(indices) % self.temporal_patch_size)

    def _check(self, frames: np.ndarray, index: int) -> None:
        count, height, width = frames.shape[0], frames.shape[1], frames.shape[2]
        if count == 0 or count % self.temporal_patch_size:
            raise DataError(f"video {index + 1} has {count} frame(s), which its temporal patch of "
                            f"{self.temporal_patch_size} frames does not divide: give a multiple of "
                            f"{self.temporal_patch_size} frames (longspan does not repeat the last one)")
        factor = self.patch_size * self.merge_size
        if height < factor or width < factor:
            raise DataError(f"video {index + 1}'s frames are {width}x{height} pixels, smaller than one merged patch "
                            f"({factor}x{factor}): give larger frames")
        if not self.do_resize and (height % factor or width % factor):
            raise DataError(f"video {index + 1}'s frames are {width}x{height} pixels and do_resize is off: each side "
                            f"must be a multiple of one merged patch ({factor})")

    def _resized(self, frames: np.ndarray) -> np.ndarray:
        """``frames`` ``[t, h, w, 3]`` uint8 resized (bicubic) to the clip's ``smart_resize`` grid."""
        from PIL import Image  # Pillow comes with transformers' image processors; only video data needs it here

        count, height, width = frames.shape[:3]
        factor = self.patch_size * self.merge_size
        max_pixels = self.size["longest_edge"]
        if self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * factor * factor, max_pixels // count),
                            int(self.size["shortest_edge"] * 1.05))
            max_pixels = per_frame * count
        new_h, new_w = smart_resize(count, height, width, self.temporal_patch_size, factor,
                                    self.size["shortest_edge"], max_pixels)
        if (new_h, new_w) == (height, width):
            return frames
        return np.stack([np.asarray(Image.fromarray(f).resize((new_w, new_h), Image.Resampling.BICUBIC))
                         for f in frames])

    def preprocess(self, frames: np.ndarray, index: int = 0) -> tuple[torch.Tensor, list[int]]:
        """(patches ``[t*h*w, 3*temporal_patch_size*patch_size^2]`` in the merger's order, grid ``[t, h, w]``)
        of one clip ``[frames, height, width, 3]`` uint8."""
        self._check(frames, index)
        if self.do_resize:
            frames = self._resized(frames)
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()  # [t, c, h, w]
        if self.do_rescale:
            video = video * self.rescale_factor
        if self.do_normalize:
            mean = torch.tensor(self.image_mean, dtype=torch.float32).view(1, -1, 1, 1)
            std = torch.tensor(self.image_std, dtype=torch.float32).view(1, -1, 1, 1)
            video = (video - mean) / std
        t, c, h, w = video.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        gt, gh, gw = t // tp, h // p, w // p
        patches = video.view(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return patches.reshape(gt * gh * gw, c * tp * p * p), [gt, gh, gw]

    def __call__(self, videos: Sequence[np.ndarray], video_metadata: Sequence[Any] = (),
                 return_metadata: bool = False, **_: Any) -> dict[str, Any]:
        """transformers' video processor contract, as ``ProcessorMixin`` calls it: ``pixel_values_videos`` and
        ``video_grid_thw`` of clips already cut to their kept frames (``[t, h, w, 3]`` uint8 each) and, with
        ``return_metadata``, their ``video_metadata`` (source fps and kept frame indices, for the timestamps).
        The processor's other keyword arguments (tensor type, text settings) do not concern the pixels."""
        if len(video_metadata) != len(videos):
            raise DataError(f"{len(videos)} video(s) came with {len(video_metadata)} metadata entries")
        outs = [self.preprocess(np.asarray(v), i) for i, v in enumerate(videos)]
        result: dict[str, Any] = {"pixel_values_videos": torch.cat([p for p, _ in outs]),
                                  "video_grid_thw": torch.tensor([g for _, g in outs], dtype=torch.long)}
        if return_metadata:
            result["video_metadata"] = list(video_metadata)
        return result


__all__ = ["Qwen3VLVideoPreprocessor", "smart_resize"]
