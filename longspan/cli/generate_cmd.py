"""``longspan generate --checkpoint DIR | --hf-model DIR --prompt TEXT [--image PATH ...] [--video PATH ...] ...``.

Loads a longspan checkpoint (a ``checkpoint.save`` directory or one of its ``iter_XXXXXXX`` directories) or a
Hugging Face model directory, continues the prompt (with ``--image`` / ``--video``: and images / videos, for a
vision-language model)
on one process with a KV cache, and prints the generated
text, or with ``--json`` one line ``{"prompt_ids": [...], "output_ids": [...], "text": "..."}``. Greedy unless
``--temperature`` > 0. Loading messages go to stderr, so stdout holds only the result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from longspan.core.errors import CheckpointError, ConfigError, LaunchError
from longspan.core.logging import get_world_size


DESCRIPTION = ("Continue a prompt with a longspan checkpoint (a checkpoint.save directory or one of its "
               "iter_XXXXXXX directories) or a Hugging Face model directory, on one process with a KV cache. "
               "Greedy unless --temperature is above 0. The text goes to stdout (with --json: prompt_ids, output_ids "
               "and text as one JSON line); loading messages go to stderr.")


def add_parser(subparsers: Any, name: str) -> None:
    """Register ``longspan generate``."""
    parser = subparsers.add_parser(name, help="generate text from a checkpoint or a Hugging Face model",
                                   description=DESCRIPTION)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="longspan checkpoint: a checkpoint.save directory or an iter_XXXXXXX directory")
    source.add_argument("--hf-model", default=None, metavar="DIR", help="Hugging Face model directory")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    parser.add_argument("--image", action="append", default=None, metavar="PATH",
                        help="an image for a vision-language model (repeatable, in order): the prompt's "
                             "<|image_pad|> tokens mark where each goes, else they go in front")
    parser.add_argument("--video", action="append", default=None, metavar="FILE_OR_FRAMES",
                        help="a video for a vision-language model with a video path (repeatable, in order): a video file (needs PyAV: "
                             "pip install 'longspan[video]') or a directory of frame images taken at --video-fps; "
                             "the prompt's <|video_pad|> tokens mark where each goes, else they go in front")
    parser.add_argument("--video-fps", type=float, default=None, metavar="FPS",
                        help="frames per second of --video frame directories")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="most tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the k most likely tokens (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="sample among tokens holding probability p (1 = all)")
    parser.add_argument("--seed", type=int, default=None, metavar="N", help="seed of the sampling generator")
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step (no KV cache)")
    parser.add_argument("--device", default=None, metavar="DEVICE", help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--json", action="store_true", help="print prompt_ids, output_ids and text as JSON")
    parser.set_defaults(func=run)


def _hf_eos_ids(hf_dir: Path, tokenizer: Any) -> list[int] | None:
    """The end-of-sequence ids transformers' ``generate`` would stop at: generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        path = hf_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return None  # the tokenizer's EOS


def _load_hf_model(hf_dir: str) -> tuple[Any, Any, list[int] | None]:
    # `longspan --help` must not import torch
    from longspan.data.tokenizers import build_tokenizer
    from longspan.training.config import TokenizerConfig

    path = Path(hf_dir)
    if not path.is_dir():
        raise CheckpointError(f"--hf-model {hf_dir} is not a directory: give a Hugging Face model directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"--hf-model {hf_dir} has no config.json: give a Hugging Face model directory")
    # `longspan --help` must not import torch
    from longspan.conversion import AutoBridge

    model = AutoBridge.from_hf_pretrained(str(path)).to_megatron_model(wrap_with_ddp=False)
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(path)))
    return model, tokenizer, _hf_eos_ids(path, tokenizer)


def _device(name: str | None) -> Any:
    """``--device`` as a torch.device (None: the default), or a one-line error."""
    import torch  # `longspan --help` must not import torch

    if not name:
        return None
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name!r}: CUDA is not available on this machine; use --device cpu")
    return device


def _load(args: argparse.Namespace) -> tuple[Any, Any, list[int] | None, list[Path]]:
    """(model chunks, tokenizer, end-of-sequence ids or None for the tokenizer's, directories that may hold the
    image processor) of the chosen source."""
    import torch  # `longspan --help` must not import torch

    device = _device(args.device)
    if args.checkpoint is not None:
        # `longspan --help` must not import torch
        from longspan.training.checkpointing.model_loading import load_model_from_checkpoint

        loaded = load_model_from_checkpoint(args.checkpoint, device=device)
        cfg = loaded.cfg
        sources = [loaded.directory, cfg.tokenizer.tokenizer_model if cfg.tokenizer is not None else None,
                   cfg.checkpoint.pretrained_checkpoint if cfg.checkpoint is not None else None]
        return loaded.model, loaded.tokenizer, None, [Path(s) for s in sources if s]
    model, tokenizer, eos_ids = _load_hf_model(args.hf_model)
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return [chunk.to(device) for chunk in model], tokenizer, eos_ids, [Path(args.hf_model)]


def _image_inputs(args: argparse.Namespace, model: list[Any], tokenizer: Any, images: list[Any],
                  processor_dirs: list[Path]) -> tuple[list[int] | str, dict[str, Any]]:
    """(prompt ids with the images' tokens, the model's image inputs) for ``--image``; the prompt as given and
    no inputs without images. A text-only model or one without an image processor is a one-line error."""
    if not images:
        return args.prompt, {}
    # `longspan --help` must not import torch
    from longspan.inference.image_generation import image_prompt_inputs
    from longspan.inference.text_generation import check_model_inputs

    net = model[0] if isinstance(model, list) else model
    check_model_inputs(net, {"pixel_values": None}, f"--image: {args.hf_model or args.checkpoint}")
    return image_prompt_inputs(net, tokenizer, args.prompt, images, processor_dirs)


def _video_inputs(args: argparse.Namespace, model: list[Any], images: list[Any],
                  processor_dirs: list[Path]) -> tuple[list[int], dict[str, Any]]:
    """(prompt ids with the videos' (and images') tokens, the model's inputs) for ``--video``."""
    # `longspan --help` must not import torch
    from longspan.inference.video_generation import check_video_model, video_processor_of, video_prompt_inputs

    net = model[0] if isinstance(model, list) else model
    check_video_model(net, f"--video: {args.hf_model or args.checkpoint}")
    processor = video_processor_of(processor_dirs)
    ids, inputs = video_prompt_inputs(processor, args.prompt, args.video, args.video_fps, images)
    device = next(net.parameters()).device
    return ids, {k: v.to(device) for k, v in inputs.items()}


def _check_videos(args: argparse.Namespace) -> None:
    """Each --video exists (before the model loads); --video-fps is positive when given."""
    for path in args.video or []:
        if not Path(path).exists():
            raise ConfigError(f"--video {path}: no such file or directory (give a video file or a directory of frames)")
    if args.video_fps is not None and not args.video_fps > 0:
        raise ConfigError(f"--video-fps={args.video_fps}: must be above 0")


def run(args: argparse.Namespace) -> int:
    from longspan.inference import check_generation_args, generate  # `longspan --help` must not import torch

    if get_world_size() > 1:
        raise LaunchError(
            f"longspan generate runs on one process, but this launch has {get_world_size()} (WORLD_SIZE): "
            "run it without torchrun/srun"
        )
    if not args.prompt:
        raise ConfigError("--prompt is empty: give the text to continue")
    check_generation_args(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    with contextlib.redirect_stdout(sys.stderr):  # library logs; stdout carries the result only
        images = []
        if args.image:
            from longspan.inference.images import load_images  # `longspan --help` must not import torch

            images = load_images(args.image)  # a bad file fails before the model loads
        _check_videos(args)
        model, tokenizer, eos_ids, processor_dirs = _load(args)
        if args.video:
            prompt, model_inputs = _video_inputs(args, model, images, processor_dirs)
        else:
            prompt, model_inputs = _image_inputs(args, model, tokenizer, images, processor_dirs)
        result = generate(
            model, tokenizer, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache, eos_ids=eos_ids,
            model_inputs=model_inputs,
        )
    if args.json:
        payload = {"prompt_ids": result.prompt_ids, "output_ids": result.output_ids, "text": result.text}
        sys.stdout.write(json.dumps(payload, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(result.text + "\n")
    return 0
