"""Multimodal chat SFT: conversations whose messages mix images and text, for vision-language models.

A record is a chat record whose message ``content`` may be a list of parts: ``{"type": "text", "text": ...}``,
``{"type": "image", "image": PATH}`` (a path relative to the data file's directory, an absolute path, a
``PIL.Image`` or a ``{"bytes"|"path"}`` mapping as ``datasets``' Image feature gives) and, for processors with a
video path (``longspan.data.sft.video``), ``{"type": "video", "video": PATH}`` (a video file) or
``{"type": "video", "video": [FRAME, ...], "fps": RATE}`` (frame images taken at RATE per second). The model
directory's HF processor (``AutoProcessor``: image processor, tokenizer, chat template, and the family's video
preprocessing) does what it does for inference: the template renders one placeholder per image or video, the
processor expands each placeholder to its tokens and returns the pixel inputs under HF's names
(``pixel_values``, ``image_grid_thw`` for Qwen2.5-VL, ``token_type_ids`` for Gemma 3, ``pixel_values_videos``,
``video_grid_thw``).

Loss: the assistant turns, found as the text chat formatter finds them but on the processor's token ids: for
assistant turn k the conversation before it (with the generation prompt) and up to it are processed with the
images they hold; both must be prefixes of the full sequence, and the tokens between them are the turn. Image
tokens and the chat's control tokens are never trained on (``chat_loss.NEVER_TRAINED_TOKENS``).

Every row is processed when the dataset is built, so a missing or unreadable image, a placeholder count that
does not match the images, or images for a processor without an image processor stop the run before its first
step with file, row and reason. A sample longer than ``seq_length + 1`` tokens is cut at the end only when the
cut leaves every image token in place; otherwise the row is an error (a cut image would misalign pixels and
tokens).
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from longspan.core.errors import ConfigError, DataError
from longspan.data.sft.chat_loss import NEVER_TRAINED_TOKENS, normalize_messages
from longspan.data.sft.formatting import SFTFormatOptions, compile_chat_template
from longspan.data.sft.video import attach_video_preprocessor, read_video, video_preprocessor

# Processor outputs aligned with the tokens (shifted and padded like them); every other output except the ones
# dropped is per image and concatenated over the images of a microbatch in sample order.
PER_TOKEN_KEYS = ("token_type_ids",)
DROPPED_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def image_only_processor_class(cls: type) -> type:
    """``cls`` without its video processor: HF's video processors need torchvision, which reading images does
    not. The class's ``get_attributes`` comes from the ``__init__`` signature, so this one's lists ``cls``'s
    parts but the video processor; ``cls.__init__`` gets None for it, and a processor that hands it on to
    ``ProcessorMixin`` by name (Gemma 4's) has it dropped there."""
    import inspect  # only this fallback reads signatures

    from transformers.processing_utils import ProcessorMixin  # transformers: optional, see load_processor

    class _WithoutVideo(ProcessorMixin):
        def __init__(self, *args: Any, video_processor: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

    parts = [name for name in cls.get_attributes() if name != "video_processor"]

    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "video_processor"}

    class ImageOnlyProcessor(cls, _WithoutVideo):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.update(zip(parts, args))
            cls.__init__(self, **kwargs, video_processor=None)

        @classmethod
        def from_args_and_dict(cls_, args: Any, processor_dict: dict[str, Any], **kwargs: Any) -> Any:
            # transformers keeps the saved settings its __init__'s code object names; this __init__ takes them
            # all by keyword, so the ones ``cls.__init__`` accepts (chat template, token counts) are kept here
            unused = kwargs.pop("return_unused_kwargs", False)
            settings = {k: v for k, v in {**processor_dict, **kwargs}.items() if k in accepted and k not in parts}
            processor = cls_(*args, **settings)
            return (processor, {}) if unused else processor

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for name in parts]
    params += [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
    ImageOnlyProcessor.__init__.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = cls.__name__
    return ImageOnlyProcessor


def has_image_processor(path: str) -> bool:
    """True when directory ``path`` holds an HF processor with an image processor: a preprocessor_config.json,
    or (transformers 5's single file) a processor_config.json with an ``image_processor`` entry."""
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        return True
    combined = os.path.join(path, "processor_config.json")
    if not os.path.isfile(combined):
        return False
    try:
        with open(combined) as f:
            return "image_processor" in json.load(f)
    except (OSError, ValueError):
        return False


def load_processor(path: str, kwargs: Optional[dict[str, Any]] = None, field: str = "dataset.hf_processor_path") -> Any:
    """The HF processor of directory ``path`` (``AutoProcessor.from_pretrained(path, **kwargs)``); one-line
    ConfigError naming ``field`` when it cannot be loaded."""
    # transformers is an optional dependency of the data layer: only multimodal data needs a processor
    from transformers import AutoProcessor
    from transformers.models.auto.processing_auto import processor_class_from_name

    kwargs = dict(kwargs or {})
    if not os.path.isdir(path):
        raise ConfigError(f"{field}={path!r} is not a directory (give the model directory holding the processor files)")
    try:
        return attach_video_preprocessor(AutoProcessor.from_pretrained(path, **kwargs), path)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for unreadable processor files
        failure = exc
    # A processor with a video processor that needs torchvision (ImportError), or whose directory has no video
    # processor files: load the image and text parts only.
    try:
        cls = processor_class_from_name(_processor_class_name(path))
        if isinstance(failure, ImportError) or "video_processor" in cls.get_attributes():
            return attach_video_preprocessor(image_only_processor_class(cls).from_pretrained(path, **kwargs), path)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - as above
        failure = exc if isinstance(failure, ImportError) else failure
    raise ConfigError(f"{field}={path!r}: cannot load the HF processor: {_first_line(failure)}") from None


def _processor_class_name(path: str) -> str:
    """The processor class a model directory names (processor_config.json, preprocessor_config.json or
    tokenizer_config.json ``processor_class``), else the one transformers maps its config.json model_type to."""
    # transformers is an optional dependency of the data layer: only multimodal data needs a processor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        found = _json_file(os.path.join(path, name)).get("processor_class")
        if isinstance(found, str):
            return found
    model_type = _json_file(os.path.join(path, "config.json")).get("model_type")
    if model_type in PROCESSOR_MAPPING_NAMES:
        return PROCESSOR_MAPPING_NAMES[model_type]
    raise ValueError("no processor_class in its processor files and no known model_type in config.json")


def _json_file(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        value = json.load(f)
    return value if isinstance(value, dict) else {}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def content_parts(messages: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The content parts of type ``kind`` ("image", "video") of a conversation, in order."""
    return [part for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == kind]


def image_parts(messages: list[dict[str, Any]]) -> list[Any]:
    """The image references of a conversation, in order."""
    return [part.get("image") for part in content_parts(messages, "image")]


def _resolved_video(part: dict[str, Any], base_dir: Optional[str]) -> tuple[Any, Any]:
    """(the video reference with relative paths joined to ``base_dir``, the part's ``fps``)."""
    ref = part.get("video")
    if isinstance(ref, (list, tuple)):
        ref = [_resolved(r, base_dir) for r in ref]
    else:
        ref = _resolved(ref, base_dir)
    return ref, part.get("fps")


def _clean_parts(messages: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Content parts without null keys (Arrow fills every part with every key any part has)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "audio":
                    raise DataError(f"{where}: audio parts are not supported yet (longspan's vision-language "
                                    "models take text, image and video parts)")
                if kind not in ("text", "image", "video"):
                    raise DataError(f"{where}: a content part must be {{\"type\": \"text\"|\"image\"|\"video\", "
                                    f"...}}, got {part!r}")
                parts.append({k: v for k, v in part.items() if v is not None})
            message = {**message, "content": parts}
        out.append(message)
    return out


def _resolved(ref: Any, base_dir: Optional[str]) -> Any:
    """A relative image path joined to ``base_dir``; other references unchanged."""
    if isinstance(ref, dict) and not ref.get("bytes") and isinstance(ref.get("path"), str):
        ref = ref["path"]
    if isinstance(ref, str) and not os.path.isabs(ref) and base_dir is not None:
        return os.path.join(base_dir, ref)
    return ref


def open_image(ref: Any, base_dir: Optional[str], where: str) -> Any:
    """An RGB ``PIL.Image`` for an image reference; one-line DataError naming the file when it is missing or
    unreadable."""
    from PIL import Image  # Pillow comes with transformers' image processors; only multimodal data needs it

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    source: Any = ref
    if isinstance(ref, dict):
        source = io.BytesIO(ref["bytes"]) if ref.get("bytes") else ref.get("path")
    if isinstance(source, str):
        path = source if os.path.isabs(source) or base_dir is None else os.path.join(base_dir, source)
        if not os.path.isfile(path):
            raise DataError(f"{where}: image {path} does not exist")
        source = path
    elif not isinstance(source, io.BytesIO):
        raise DataError(f"{where}: an image part needs a path, got {ref!r}")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a damaged file
        name = source if isinstance(source, str) else "(inline bytes)"
        raise DataError(f"{where}: image {name} cannot be read: {_first_line(exc)}") from None


@dataclass
class MultimodalDocument:
    """One processed conversation: token ids, a 0/1 loss flag per id, and the images (references) it holds."""

    ids: np.ndarray
    in_loss: np.ndarray
    images: list[Any]
    """Absolute paths (or in-memory images) in the order of the text's placeholders."""
    text: str
    """The rendered conversation (processed again with the images when the sample is read)."""
    where: str
    """'file line N' / 'source row N' for messages."""
    cut: bool = False
    """Whether the conversation was longer than the sample and cut at the end."""
    videos: list[tuple[Any, Any]] = field(default_factory=list)
    """(resolved video reference, fps of its frames or None) in the order of the text's video placeholders."""


class MultimodalChatFormatter:
    """Chat records (with or without images) -> ``MultimodalDocument`` through an HF processor."""

    def __init__(self, processor: Any, opts: SFTFormatOptions, max_ids: int, base_dir: Optional[str],
                 chat_template: Optional[str] = None) -> None:
        if not opts.train_on_think:
            raise ConfigError("dataset_kwargs.train_on_think=False is not supported for multimodal data yet")
        self.processor = processor
        self.opts = opts
        self.max_ids = max_ids
        self.base_dir = base_dir
        self.template = chat_template or getattr(processor, "chat_template", None)
        tokenizer = processor.tokenizer
        self.specials = {name: getattr(tokenizer, name, None) or "" for name in ("bos_token", "eos_token", "pad_token")}
        self.image_token_ids = _image_token_ids(processor)
        video_token = getattr(processor, "video_token_id", None)
        self.video_token_ids = [int(video_token)] if isinstance(video_token, int) else []
        vocab = tokenizer.get_vocab()
        self.never_trained = np.asarray(sorted({vocab[t] for t in NEVER_TRAINED_TOKENS if t in vocab}
                                               | set(self.image_token_ids) | set(self.video_token_ids)), dtype=np.int64)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, where: str) -> str:
        import jinja2  # not a declared dependency (torch brings it); only chat templates need it

        try:
            return compile_chat_template(self.template)(messages=messages, add_generation_prompt=add_generation_prompt,
                                                        **self.specials)
        except jinja2.exceptions.TemplateError as exc:
            raise DataError(f"{where}: the chat template failed on this record: {_first_line(exc)}") from None

    def process(self, text: str, images: list[Any], where: str,
                videos: Optional[list[tuple[np.ndarray, Any]]] = None) -> dict[str, torch.Tensor]:
        """The processor's outputs for one text, its opened images and its read videos ((frames, metadata) as
        ``read_video`` gives them; batch dimension 1)."""
        if images and getattr(self.processor, "image_processor", None) is None:
            raise DataError(f"{where}: the conversation has images, but the processor has no image processor "
                            "(a text-only model)")
        extra: dict[str, Any] = {}
        if videos:
            extra = {"videos": [v for v, _ in videos], "video_metadata": [m for _, m in videos]}
        try:
            return dict(self.processor(text=[text], images=images or None, return_tensors="pt", **extra))
        except DataError as exc:  # the video preprocessing's refusals (frame counts, frame sizes)
            raise DataError(f"{where}: {exc}") from None
        except ValueError as exc:  # the processor's own check: placeholders vs images and videos
            kind = "images and videos do not match the text's image and video" if videos else \
                "images do not match the text's image"
            raise DataError(f"{where}: the {kind} tokens: {_first_line(exc)}") from None

    def read_videos(self, refs: list[tuple[Any, Any]], where: str) -> list[tuple[np.ndarray, Any]]:
        """The (kept frames, metadata) of a conversation's videos; a processor without a video path is a
        one-line DataError."""
        if not refs:
            return []
        pre = video_preprocessor(self.processor)
        if pre is None:
            raise DataError(f"{where}: the conversation has a video, but {type(self.processor).__name__} has no video "
                            "path in longspan; drop the video parts")
        return [read_video(ref, fps, pre, where) for ref, fps in refs]

    def __call__(self, record: dict[str, Any], where: str, base_dir: Optional[str] = None) -> MultimodalDocument:
        """The processed conversation; relative image paths are read from ``base_dir`` (default: the
        formatter's)."""
        if self.template is None:
            raise DataError(f"{where}: a chat record, but the processor has no chat template")
        messages = _clean_parts(normalize_messages(record.get(self.opts.messages_key), self.opts.messages_key, where),
                                where)
        base_dir = base_dir if base_dir is not None else self.base_dir
        refs = [_resolved(ref, base_dir) for ref in image_parts(messages)]
        video_refs = [_resolved_video(part, base_dir) for part in content_parts(messages, "video")]
        videos = self.read_videos(video_refs, where)
        images = [open_image(ref, None, where) for ref in refs]
        text = self.render(messages, False, where)
        out = self.process(text, images, where, videos)
        ids = out["input_ids"][0].numpy().astype(np.int64)
        self._check_image_tokens(ids, out, len(images), where)
        flags = self._loss_flags(messages, ids, images, where, videos)
        cut = len(ids) > self.max_ids
        if cut:
            if np.isin(ids[self.max_ids:], self.image_token_ids + self.video_token_ids).any():
                raise DataError(f"{where}: the conversation is {len(ids)} tokens, longer than {self.max_ids}, and the "
                                "cut would split its image tokens: raise seq_length or shorten the conversation")
            ids, flags = ids[: self.max_ids], flags[: self.max_ids]
        return MultimodalDocument(ids, flags, refs, text, where, cut, video_refs)

    def _check_image_tokens(self, ids: np.ndarray, out: dict[str, torch.Tensor], n_images: int, where: str) -> None:
        """The image tokens of the sequence are the count the processor's image inputs stand for."""
        found = int(np.isin(ids, self.image_token_ids).sum())
        check_image_grids(self.processor, out, where)
        expected = expected_image_tokens(self.processor, out, n_images)
        if expected is not None and found != expected:
            raise DataError(f"{where}: the text has {found} image tokens, but its {n_images} image(s) need {expected}")
        grid = out.get("video_grid_thw")
        merge = getattr(video_preprocessor(self.processor), "merge_size", None)
        if grid is not None and merge:
            found, expected = int(np.isin(ids, self.video_token_ids).sum()), int(grid.prod(dim=-1).sum()) // merge ** 2
            if found != expected:
                raise DataError(f"{where}: the text has {found} video tokens, but its video(s) need {expected}")

    def _loss_flags(self, messages: list[dict[str, Any]], ids: np.ndarray, images: list[Any], where: str,
                    videos: list[tuple[np.ndarray, Any]]) -> np.ndarray:
        mode = self.opts.loss_mode if self.opts.answer_only_loss else "full"
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant and mode != "full":
            raise DataError(f"{where}: the conversation has no assistant turn, so nothing would be trained on")
        flags = np.ones(len(ids), dtype=np.int8) if mode == "full" else np.zeros(len(ids), dtype=np.int8)
        if mode != "full":
            for k in assistant[-1:] if mode == "last_turn" else assistant:
                start, end = self._turn_tokens(messages, k, ids, images, where, videos)
                flags[start:end] = 1
        flags[np.isin(ids, self.never_trained)] = 0
        return flags

    def _turn_tokens(self, messages: list[dict[str, Any]], k: int, ids: np.ndarray, images: list[Any],
                     where: str, videos: list[tuple[np.ndarray, Any]]) -> tuple[int, int]:
        """Token indices [start, end) of assistant turn ``k``: the tokens the turn adds after the generation
        prompt, both renders processed with the images and videos they hold."""
        def held(upto: int) -> tuple[list[Any], list[tuple[np.ndarray, Any]]]:
            return images[: len(image_parts(messages[:upto]))], videos[: len(content_parts(messages[:upto], "video"))]

        before = self._prefix_ids(messages[:k], True, *held(k), where)
        if k + 1 == len(messages):
            upto = ids
        else:
            upto = self._prefix_ids(messages[: k + 1], False, *held(k + 1), where)
        if not (len(upto) <= len(ids) and np.array_equal(ids[: len(upto)], upto)
                and len(before) <= len(upto) and np.array_equal(upto[: len(before)], before)):
            raise DataError(
                f"{where}: cannot find assistant turn {k} in the processed conversation (processing the conversation "
                "up to it is not a prefix of the whole; the template rewrites earlier turns or tokens merge across turns)")
        return len(before), len(upto)

    def _prefix_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool, images: list[Any],
                    videos: list[tuple[np.ndarray, Any]], where: str) -> np.ndarray:
        text = self.render(messages, add_generation_prompt, where)
        return self.process(text, images, where, videos)["input_ids"][0].numpy().astype(np.int64)

    def pixel_inputs(self, doc: MultimodalDocument) -> dict[str, torch.Tensor]:
        """The processor's image inputs and per-token inputs of a document (processed again: only ids, flags and
        image references are kept in memory)."""
        if not doc.images and not doc.videos:
            return {}
        images = [open_image(ref, None, doc.where) for ref in doc.images]
        out = self.process(doc.text, images, doc.where, self.read_videos(doc.videos, doc.where))
        full = out["input_ids"][0]
        if not torch.equal(full[: len(doc.ids)], torch.from_numpy(doc.ids)):
            raise DataError(f"{doc.where}: the processor gives other tokens than when the dataset was built "
                            "(an image or video changed on disk?)")
        inputs = {k: v for k, v in out.items() if k not in DROPPED_KEYS}
        for key in PER_TOKEN_KEYS:
            if key in inputs:
                inputs[key] = inputs[key][0, : len(doc.ids)]
        return inputs


def _image_token_ids(processor: Any) -> list[int]:
    """Ids of the tokens that stand for image content (Qwen's ``<|image_pad|>``, Gemma's soft tokens)."""
    # ``image_token_ids`` are the ids the processor expands the images into; ``image_token_id`` is the text's
    # placeholder, the same token for Qwen but Gemma's ``<start_of_image>`` (an ordinary token the model keeps)
    found = set()
    for name in ("image_token_ids", "image_token_id"):
        value = getattr(processor, name, None)
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, (list, tuple, set)):
            found.update(int(v) for v in value if isinstance(v, int))
        if found:
            break
    token = getattr(processor, "image_token", None)
    if not found and isinstance(token, str):
        tid = processor.tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid >= 0:
            found.add(tid)
    return sorted(found)


def check_image_grids(processor: Any, out: dict[str, torch.Tensor], where: str) -> None:
    """Images the model pools by patch position (Gemma 4: ``image_position_ids``, the image processor's
    ``pooling_kernel_size``) must be whole squares of the kernel on each side: one-line DataError naming
    ``where`` and the image otherwise (an image too small for one pooled soft token)."""
    positions = out.get("image_position_ids")
    kernel = getattr(getattr(processor, "image_processor", None), "pooling_kernel_size", None)
    if positions is None or not kernel:
        return
    real = ~(positions == -1).all(dim=-1)
    for i in range(positions.shape[0]):
        grid = positions[i][real[i]]
        width, height = ((int(grid[:, axis].max()) + 1) if grid.numel() else 0 for axis in range(2))
        if width < kernel or height < kernel or width % kernel or height % kernel:
            raise DataError(f"{where}: image {i + 1} is {width}x{height} patches, too small or uneven for one "
                            f"{kernel}x{kernel} pooled soft token per square (each side a multiple of {kernel}): "
                            "let the processor resize it (do_resize) or give a larger image")


def expected_image_tokens(processor: Any, out: dict[str, torch.Tensor], n_images: int) -> Optional[int]:
    """How many image tokens the processed images stand for: Qwen-style grids (patches / merge_size^2) or a fixed
    count per image (``image_seq_length``); None when the processor says neither."""
    if n_images == 0:
        return 0
    positions = out.get("image_position_ids")
    kernel = getattr(getattr(processor, "image_processor", None), "pooling_kernel_size", None)
    if positions is not None and kernel:  # Gemma 4: each image's real patches pooled kernel x kernel
        return int((~(positions == -1).all(dim=-1)).sum()) // int(kernel) ** 2
    grid = out.get("image_grid_thw")
    merge = getattr(getattr(processor, "image_processor", None), "merge_size", None)
    if grid is not None and merge:
        return int(grid.prod(dim=-1).sum()) // int(merge) ** 2
    per_image = getattr(processor, "image_seq_length", None) or getattr(processor, "num_image_tokens", None)
    return int(per_image) * n_images if per_image else None


class MultimodalSFTDataset(torch.utils.data.Dataset):
    """Processed multimodal conversations with ``SFTDataset``'s samples; batches add the pixel inputs.

    Args:
        docs: the processed conversations.
        formatter: the formatter that made them (it processes the images again on access).
        seq_length: tokens per sample.
        opts: padding options (``pad_to_max_length``, ``pad_seq_length_to_mult``).
        pad_id: the padding token id.
        samples: sample index -> document index.
    """

    def __init__(self, docs: list[MultimodalDocument], formatter: MultimodalChatFormatter, seq_length: int,
                 opts: SFTFormatOptions, pad_id: int, samples: Any) -> None:
        self.docs, self.formatter, self.seq_length, self.opts = docs, formatter, seq_length, opts
        self.pad_id, self.samples = pad_id, samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        doc = self.docs[self.samples[i]]
        ids = torch.from_numpy(doc.ids)
        sample = {
            "tokens": ids[:-1],
            "labels": ids[1:],
            "loss_mask": torch.from_numpy(doc.in_loss[1:].astype(np.float32)),
            "position_ids": torch.arange(len(ids) - 1),
        }
        for key, value in self.formatter.pixel_inputs(doc).items():
            sample[key] = value[:-1] if key in PER_TOKEN_KEYS else value
        return sample

    def padded_length(self, longest: int) -> int:
        if self.opts.pad_to_max_length:
            return self.seq_length
        mult = self.opts.pad_seq_length_to_mult
        return min(-(-longest // mult) * mult, max(self.seq_length, longest))

    def collate_fn(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Right-pad tokens (and per-token inputs, with 0); concatenate the image inputs in sample order."""
        return collate_multimodal(samples, self.padded_length(max(s["tokens"].numel() for s in samples)), self.pad_id)


def collate_multimodal(samples: list[dict[str, torch.Tensor]], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """A microbatch of multimodal samples padded to ``length``: the images of sample 0 first, then sample 1's..."""
    b = len(samples)
    out = {
        "tokens": torch.full((b, length), pad_id, dtype=torch.long),
        "labels": torch.full((b, length), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros((b, length), dtype=torch.float32),
        "position_ids": torch.arange(length).repeat(b, 1),
        "real_tokens": torch.tensor([s["tokens"].numel() for s in samples], dtype=torch.long),
    }
    per_token = sorted({k for s in samples for k in s if k in PER_TOKEN_KEYS})
    for key in per_token:
        out[key] = torch.zeros((b, length), dtype=torch.long)
    for row, s in enumerate(samples):
        n = s["tokens"].numel()
        for key in ("tokens", "labels", "loss_mask", *per_token):
            if key in s:
                out[key][row, :n] = s[key]
    out.update(concat_image_inputs(samples, set(out)))
    return out


def concat_image_inputs(samples: list[dict[str, torch.Tensor]], aligned: set[str]) -> dict[str, torch.Tensor]:
    """The samples' per-image inputs (every key but the token-aligned ``aligned``) concatenated in sample order:
    the order of the image tokens in the microbatch."""
    keys = sorted({k for s in samples for k in s if k not in aligned})
    return {key: torch.cat([s[key] for s in samples if key in s], dim=0) for key in keys}


def build_multimodal_jsonl_split(path: str, processor: Any, opts: SFTFormatOptions, seq_length: int, samples: Any,
                                 pad_id: int, chat_template: Optional[str] = None, index_workers: int = 1,
                                 cache_dir: Optional[str] = None) -> MultimodalSFTDataset:
    """One JSONL split of chat records with images (paths relative to the file's directory), every row
    processed now (see the module docstring). ``samples`` maps sample index -> row (built from the row count)."""
    docs, formatter = build_multimodal_docs(path, processor, opts, seq_length, chat_template, index_workers, cache_dir)
    return MultimodalSFTDataset(docs, formatter, seq_length, opts, pad_id, samples(len(docs)))


def build_multimodal_docs(path: str, processor: Any, opts: SFTFormatOptions, seq_length: int,
                          chat_template: Optional[str] = None, index_workers: int = 1,
                          cache_dir: Optional[str] = None) -> tuple[list[MultimodalDocument], MultimodalChatFormatter]:
    """Every row of a JSONL file of chat records processed (samples of at most ``seq_length`` tokens), and the
    formatter that processed them."""
    from longspan.data.sft.jsonl_index import JsonlIndex  # the JSONL index sits beside this module

    index = JsonlIndex(path, workers=index_workers, cache_dir=cache_dir)
    if len(index) == 0:
        raise DataError(f"{path} has no records")
    formatter = MultimodalChatFormatter(processor, opts, seq_length + 1, os.path.dirname(os.path.abspath(path)),
                                        chat_template)

    def locate(item: int) -> str:
        return f"{path} line {index.line_number(item)}"

    return [_checked(formatter(index.record(i), locate(i)), locate(i)) for i in range(len(index))], formatter


def _checked(doc: MultimodalDocument, where: str) -> MultimodalDocument:
    if len(doc.ids) < 2:
        raise DataError(f"{where}: the record gives {len(doc.ids)} token(s); a sample needs at least 2")
    return doc


def processor_for_tokenizer(tokenizer: Any) -> Optional[Any]:
    """The HF processor of the tokenizer's model directory when it holds an image processor, else None."""
    path = getattr(tokenizer, "path", None)
    if not isinstance(path, str) or not has_image_processor(path):
        return None
    return load_processor(path, field="tokenizer.tokenizer_model")
