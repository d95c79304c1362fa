"""Generation from a vision-language model: a prompt with images, the model's HF processor, a KV cache.

``generate_with_images(model, processor, prompt, images)`` runs the HF processor (the image processor turns the
images into ``pixel_values``; the tokenizer expands each image marker of the prompt into the image's tokens and,
for Gemma 3, marks them in ``token_type_ids``), feeds every processor output but the token ids to the first
forward (the prompt), then decodes through ``generate`` itself (its KV cache, sampling and stopping rules). ``generate_from_hf_with_images`` does it for an HF model directory (the
weights through ``AutoBridge``, the processor from the same directory). ``prompt_inputs`` gives the prompt's ids
and the model's image inputs alone, for a caller with its own decoding loop (``longspan generate --image``).

The processor's outputs keep HF's names (``pixel_values``, ``token_type_ids``, ...): the model's forward takes
them as keyword arguments (``longspan.models.vlm``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from longspan.core.errors import CheckpointError, ConfigError, DataError
from longspan.data.sft.multimodal import load_processor as load_hf_processor
from longspan.inference.text_generation import GenerationResult, _single_model, check_generation_args, generate
from longspan.inference.images import expand_image_tokens, load_image_processor, load_images, process_images

#: processor outputs the model does not take: the token ids go positionally, the padding mask is HF's 2-D one
#: (one prompt has no padding)
_NOT_MODEL_INPUTS = ("input_ids", "attention_mask")


def load_processor(hf_path: str | os.PathLike) -> Any:
    """The HF processor (image processor + tokenizer + chat template) saved in model directory ``hf_path``
    (without its video processor when that one cannot load: ``longspan.data.sft.multimodal.load_processor``)."""
    try:
        return load_hf_processor(str(hf_path), field="processor")
    except ConfigError as exc:
        first = str(exc).split("cannot load the HF processor: ", 1)[-1]
        raise CheckpointError(f"{hf_path} has no HF processor that loads ({first}): it needs the processor's "
                              "files (processor_config.json or preprocessor_config.json, the tokenizer)") from None


def prompt_inputs(processor: Any, prompt: str, images: Sequence[Any]) -> tuple[list[int], dict[str, torch.Tensor]]:
    """(the prompt's token ids with each image's tokens, the model's other inputs: ``pixel_values``,
    ``token_type_ids``, ...) from the HF processor; what ``generate(..., model_inputs=...)`` takes for a prompt
    with images. ``images``: paths or PIL images."""
    inputs = processor_inputs(processor, prompt, load_images(images))
    return inputs["input_ids"][0].tolist(), {k: v for k, v in inputs.items() if k not in _NOT_MODEL_INPUTS}


def processor_inputs(processor: Any, prompt: str, images: Sequence[Any]) -> dict[str, torch.Tensor]:
    """The processor's tensors for one prompt and its images (one-line DataError when they do not match)."""
    # Gemma 3's prompts mark an image with its begin-of-image token, Gemma 4's with its image token: the one
    # the prompt holds (else the first the processor has) is counted
    markers = [m for m in (getattr(processor, "boi_token", None), getattr(processor, "image_token", None)) if m]
    marker = next((m for m in markers if m in prompt), markers[0] if markers else None)
    if marker and prompt.count(marker) != len(images):
        raise DataError(f"the prompt has {prompt.count(marker)} image marker(s) {marker} for {len(images)} "
                        f"image(s): put one {marker} where each image goes")
    try:
        inputs = processor(text=prompt, images=list(images) or None, return_tensors="pt")
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        raise DataError(f"the processor refused the prompt and its {len(images)} image(s): {first}") from None
    return dict(inputs)


#: files of a model directory that hold its HF processor (transformers 5 writes processor_config.json alone)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def image_prompt_inputs(net: nn.Module, tokenizer: Any, prompt: str, images: Sequence[Any],
                        processor_dirs: Sequence[str | os.PathLike]) -> tuple[list[int], dict[str, torch.Tensor]]:
    """(prompt ids with the images' tokens, the model's image inputs) for a prompt about ``images``, by model:
    Qwen2.5-VL (a patch merger: images of any size) runs its image processor and repeats each image mark once
    per merged patch (``longspan.inference.images``); other models (Gemma 3) run the whole HF processor of
    the first of ``processor_dirs`` that has one (``prompt_inputs``). No processor is a one-line error."""
    dirs = [Path(d) for d in processor_dirs]
    wanted = PROCESSOR_FILES[1:] if getattr(net, "merger", None) is not None else PROCESSOR_FILES
    found = [d for d in dirs if any((d / name).is_file() for name in wanted)]
    if not found:
        raise CheckpointError(f"no {' or '.join(wanted)} (the image processor) in "
                              f"{', '.join(str(d) for d in dirs)}: images need the model's processor")
    device = next(net.parameters()).device
    if getattr(net, "merger", None) is not None:
        inputs = process_images(load_image_processor(found[0]), load_images(images))
        prompt_ids = expand_image_tokens(tokenizer.tokenize(prompt), inputs["image_grid_thw"], net.config)
    else:
        prompt_ids, inputs = prompt_inputs(load_processor(found[0]), prompt, images)
    return prompt_ids, {k: v.to(device) for k, v in inputs.items()}


@torch.inference_mode()
def generate_with_images(
    model: nn.Module | Sequence[nn.Module],
    processor: Any,
    prompt: str,
    images: Sequence[Any],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    *,
    eos_ids: Sequence[int] | None = None,
    return_logits: bool = False,
) -> GenerationResult:
    """Continue ``prompt`` (text with one image marker per image, e.g. Gemma 3's ``<start_of_image>``) about
    ``images`` (paths or PIL images) with up to ``max_new_tokens`` tokens; arguments as ``generate``."""
    check_generation_args(max_new_tokens, temperature, top_k, top_p)  # before the images are read
    net = _single_model(model)
    prompt_ids, extra = prompt_inputs(processor, prompt, images)
    device = next(net.parameters()).device
    extra = {k: v.to(device) for k, v in extra.items()}
    return generate(net, _HFTokenizerView(processor.tokenizer), prompt_ids, max_new_tokens, temperature, top_k,
                    top_p, seed, eos_ids=eos_ids, return_logits=return_logits, model_inputs=extra)


class _HFTokenizerView:
    """An HF tokenizer seen as a longspan one by ``generate``: its EOS and its decoding."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos = getattr(tokenizer, "eos_token_id", None)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)


def generate_from_hf_with_images(hf_path: str | os.PathLike, prompt: str, images: Sequence[Any],
                                 **kwargs: Any) -> GenerationResult:
    """``generate_with_images`` for the HF vision-language model directory ``hf_path`` (weights imported
    through ``AutoBridge``, the processor read from the same directory); ``kwargs`` as
    ``generate_with_images``."""
    from longspan.conversion.bridge import AutoBridge  # the conversion stack loads only when asked for

    images = load_images(images)  # a bad image fails before the model is built
    processor = load_processor(hf_path)
    model = AutoBridge.from_hf_pretrained(hf_path).to_megatron_model()
    return generate_with_images(model, processor, prompt, images, **kwargs)


__all__ = ["PROCESSOR_FILES", "generate_from_hf_with_images", "generate_with_images", "image_prompt_inputs",
           "load_images", "load_processor", "processor_inputs", "prompt_inputs"]
