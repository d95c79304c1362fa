"""Videos in multimodal chat data and prompts: which processors have a video path, and reading the clips.

A model family whose HF processor takes videos registers its own preprocessing under the processor's class name
(``register_video_preprocessor``): transformers' video processors need torchvision, which cannot be installed
beside every torch build, so the family's preprocessing stands in for the HF video processor
(``attach_video_preprocessor``) and the HF processor writes the prompt from its outputs as it would from its own.
A processor without a registered preprocessing has no video path: a video part is a one-line error.

A preprocessing object is what transformers' ``ProcessorMixin`` calls as ``video_processor`` (clips already cut
to their kept frames, ``video_metadata``), plus ``frame_indices(total, fps)``: the frames a decoded video keeps.

Video references (``read_video``): a video file, decoded through PyAV (the ``video`` extra), or a list of frame
image files (or a directory of them, in name order) taken at ``fps`` frames per second, kept as given.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import numpy as np

from longspan.core.errors import DataError
from longspan.core.plugins import load_plugins

_PREPROCESSORS: dict[str, Callable[[str], Any]] = {}

#: the image files a frame directory's frames are read from
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def register_video_preprocessor(processor_class: str, load: Callable[[str], Any]) -> None:
    """Videos for HF processors of class ``processor_class``: ``load(model_dir)`` gives the preprocessing."""
    _PREPROCESSORS[processor_class] = load


def attach_video_preprocessor(processor: Any, path: str) -> Any:
    """``processor`` with its family's video preprocessing (read from model directory ``path``) as its
    ``video_processor`` when one is registered for its class; unchanged otherwise."""
    load_plugins()
    # by HF's class names (transformers' own ``processor_class`` registry), along the MRO: the processor may be
    # loaded as ``image_only_processor_class``'s subclass of the named class
    for cls in type(processor).__mro__:
        load = _PREPROCESSORS.get(cls.__name__)
        if load is not None:
            processor.video_processor = load(path)
            break
    return processor


def video_preprocessor(processor: Any) -> Optional[Any]:
    """The processor's video preprocessing when it has a video path in longspan, else None."""
    found = getattr(processor, "video_processor", None)
    return found if found is not None and hasattr(found, "frame_indices") else None


def read_video(ref: Any, fps: Any, preprocessor: Any, where: str) -> tuple[np.ndarray, Any]:
    """(kept frames ``[t, h, w, 3]`` uint8, transformers' ``VideoMetadata`` of the source) of a video
    reference: a file path (decoded, frames kept by ``preprocessor.frame_indices``), a list of frame image
    paths or a directory of frame images (all kept; ``fps``: the rate they were taken at). Paths must be
    resolved already; one-line DataError naming ``where`` and the file otherwise."""
    from transformers.video_utils import VideoMetadata  # transformers: only multimodal data needs it

    if isinstance(ref, str) and os.path.isdir(ref):
        ref = sorted(os.path.join(ref, n) for n in os.listdir(ref) if n.lower().endswith(FRAME_SUFFIXES))
        if not ref:
            raise DataError(f"{where}: the frame directory holds no {'/'.join(FRAME_SUFFIXES)} images")
    if isinstance(ref, (list, tuple)):
        frames = _read_frames(list(ref), where)
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0:
            raise DataError(f"{where}: a video given as frames needs \"fps\" (the rate they were taken at, > 0), "
                            f"got {fps!r}")
        indices = list(range(len(frames)))
        total = len(frames)
    elif isinstance(ref, str):
        frames, fps, total, indices = _decode(ref, preprocessor, where)
    else:
        raise DataError(f"{where}: a video part needs a file path or a list of frame image paths, got {ref!r}")
    meta = VideoMetadata(total_num_frames=total, fps=float(fps), width=int(frames.shape[2]),
                         height=int(frames.shape[1]), duration=total / float(fps), video_backend="longspan",
                         frames_indices=indices)
    return frames, meta


def _read_frames(paths: list[Any], where: str) -> np.ndarray:
    """The frame images ``[t, h, w, 3]`` uint8 of one video; one-line DataError naming a missing, unreadable or
    odd-sized frame."""
    from PIL import Image  # Pillow comes with transformers' image processors; only frame videos need it

    if not paths:
        raise DataError(f"{where}: a video given as frames has no frames")
    frames = []
    for path in paths:
        if not isinstance(path, str) or not os.path.isfile(path):
            raise DataError(f"{where}: video frame {path} does not exist")
        try:
            with Image.open(path) as image:
                frames.append(np.asarray(image.convert("RGB")))
        except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a damaged file
            raise DataError(f"{where}: video frame {path} cannot be read: {type(exc).__name__}") from None
    shapes = {f.shape for f in frames}
    if len(shapes) > 1:
        raise DataError(f"{where}: the frames of a video differ in size ({sorted(s[:2] for s in shapes)}): "
                        "give frames of one size")
    return np.stack(frames)


def _decode(path: str, preprocessor: Any, where: str) -> tuple[np.ndarray, float, int, list[int]]:
    """(kept frames, source fps, frame count, kept indices) of a video file through PyAV."""
    if not os.path.isfile(path):
        raise DataError(f"{where}: video {path} does not exist")
    try:
        import av  # optional: the ``video`` extra; only video files need it
    except ImportError:
        raise DataError(f"{where}: video {path} needs PyAV to be decoded: pip install 'longspan[video]'") from None
    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate) if stream.average_rate else 0.0
            # the container's frame count, as transformers' PyAV reader takes it; counted by decoding (a second
            # pass) only where the container does not record it
            total = stream.frames or sum(1 for _ in container.decode(stream))
        if total == 0 or fps <= 0:
            raise ValueError(f"{total} decodable frame(s) at {fps} fps")
        indices = preprocessor.frame_indices(total, fps)
        wanted = set(indices)
        with av.open(path) as container:
            kept = {i: f.to_ndarray(format="rgb24") for i, f in enumerate(container.decode(container.streams.video[0]))
                    if i in wanted}
        if len(kept) < len(wanted):
            raise ValueError(f"{total} frames recorded, but frame {max(wanted - set(kept))} does not decode")
        return np.stack([kept[i] for i in indices]), fps, total, indices
    except Exception as exc:  # noqa: BLE001 - PyAV raises many kinds for a damaged file
        text = str(exc).strip().splitlines()
        reason = text[0][:200] if text else type(exc).__name__
        raise DataError(f"{where}: video {path} cannot be read: {reason}") from None


__all__ = ["FRAME_SUFFIXES", "attach_video_preprocessor", "read_video", "register_video_preprocessor",
           "video_preprocessor"]
