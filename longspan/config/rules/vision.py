"""Config rules of the image fields of a vision-language model with a SigLIP encoder and pooled image tokens:
the encoder's ``vision_config`` and ``mm_tokens_per_image``. A provider is recognised by its ``mm_tokens_per_image``
field (this package sits below ``models``). ``validate()`` runs
:func:`check_image_model`; the model runs it too when the provider is used on its own."""

from __future__ import annotations

import math
from typing import Any

from longspan.core.errors import ConfigError, NotSupportedError

#: SigLIP ``hidden_act`` values the vision encoder implements
SUPPORTED_VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu")

#: vision_config keys that must be positive integers
_VISION_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                 "patch_size")


def is_image_model(config: Any) -> bool:
    """A provider with a SigLIP encoder and pooled image tokens: it has ``mm_tokens_per_image``."""
    return hasattr(config, "mm_tokens_per_image")


def check_image_model(config: Any) -> None:
    """The image fields of ``config`` (nothing for other providers): one-line errors naming the field."""
    if not is_image_model(config):
        return
    vision = config.vision_config or {}
    for key in _VISION_SIZES:
        value = vision.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model.vision_config.{key}={value!r} is invalid: give a positive integer")
    if vision.get("vision_use_head"):
        raise NotSupportedError("model.vision_config.vision_use_head=True is not supported: the model uses every "
                                "patch vector (set it to false)")
    act = vision.get("hidden_act", "gelu_pytorch_tanh")
    if act not in SUPPORTED_VISION_ACTIVATIONS:
        raise NotSupportedError(f"model.vision_config.hidden_act={act!r} is not supported: use one of "
                                f"{', '.join(SUPPORTED_VISION_ACTIVATIONS)}")
    if vision["hidden_size"] % vision["num_attention_heads"]:
        raise ConfigError(f"model.vision_config.hidden_size={vision['hidden_size']} is not a multiple of "
                          f"num_attention_heads={vision['num_attention_heads']}")
    grid = vision["image_size"] // vision["patch_size"]
    tokens = config.mm_tokens_per_image
    side = math.isqrt(tokens) if isinstance(tokens, int) and tokens > 0 else 0
    if side == 0 or side * side != tokens or grid % side:
        raise ConfigError(f"model.mm_tokens_per_image={tokens!r} is invalid: give a square number whose side "
                          f"divides the {grid}x{grid} patch grid (vision_config image_size // patch_size)")
