"""Video inputs for the Qwen3-VL tests: a chat template with video parts, a video processor's settings, frame
files, an mpeg4 clip (PyAV) and a chat row with a video part."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
            "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'video' %}"
            "<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VIDEO_SETTINGS = {"size": {"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 64}, "patch_size": 16,
                  "temporal_patch_size": 2, "merge_size": 2, "fps": 2, "min_frames": 2, "max_frames": 8,
                  "video_processor_type": "Qwen3VLVideoProcessor"}


def video_frames(root: Path, name: str, count: int, size: tuple[int, int], seed: int) -> list[str]:
    """``count`` random frames of ``size`` (width, height) as PNG files under ``root/name``; relative paths."""
    rng = np.random.default_rng(seed)
    (root / name).mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(root / name / f"{i}.png")
        paths.append(f"{name}/{i}.png")
    return paths


def encode_video(path: Path, count: int, fps: int) -> None:
    """A 64x48 mpeg4 video of ``count`` frames at ``fps`` (PyAV)."""
    import av

    rng = np.random.default_rng(7)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for _ in range(count):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def video_row(video: object, fps: float | None = None, answer: str = "red") -> dict:
    part = {"type": "video", "video": video, **({"fps": fps} if fps is not None else {})}
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "what colour"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}


def add_video_processor(hf_dir: Path) -> None:
    """Give a tiny Qwen3-VL directory a template with video parts and a video processor's settings."""
    (hf_dir / "chat_template.jinja").write_text(TEMPLATE)
    (hf_dir / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_SETTINGS))
