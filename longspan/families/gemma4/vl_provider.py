"""``Gemma4VLModelProvider``: Gemma 4's vision-language model (``Gemma4ForConditionalGeneration`` with images);
``provide()`` builds ``longspan.families.gemma4.vl_model.Gemma4VLModel``.

The GPT and Gemma 4 fields describe the language model (Gemma 4's text model, ``Gemma4ModelProvider``);
``vision_config`` the vision encoder (HF's ``Gemma4VisionConfig`` fields, as in config.json).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.families.gemma4.provider import Gemma4ModelProvider
from longspan.models.vlm.provider import VisionLanguageProvider

#: vision_config keys that must be positive integers
_VISION_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "patch_size", "pooling_kernel_size", "position_embedding_size")


@dataclass
class Gemma4VLModelProvider(Gemma4ModelProvider, VisionLanguageProvider):
    """A Gemma 4 vision-language model: Gemma 4's vision encoder and projector feeding a Gemma 4 text model.

    Layouts: data parallel, FSDP2 and tensor parallel (the language model split, the encoder and projector
    replicated), on images mixed with text-only conversations (tests/data/sft_vlm/test_gemma4_vlm_finetune.py);
    with image tokens attending both ways, pipeline parallel (the encoder and projector on the first stage; the
    stage carry hands on which tokens are image tokens), tensor parallel with sequence parallel and context
    parallel (tests/data/sft_vlm/test_gemma4_vlm_layouts.py)."""

    scatter_embedding_sequence_parallel: bool = False
    """Whether the embeddings are scattered across the sequence-parallel ranks right after the lookup: False, as
    the image embeddings are put into the whole sequence's embeddings first; True with sequence parallel is a
    one-line error."""

    vision_config: dict[str, Any] = field(default_factory=dict)
    """The vision encoder: HF ``Gemma4VisionConfig`` fields (``hidden_size``, ``intermediate_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``patch_size``,
    ``pooling_kernel_size``, ``position_embedding_size``, ``rms_norm_eps``, ``hidden_activation``,
    ``use_clipped_linears``, ``standardize``, ``rope_parameters``)."""

    bos_token_id: int = 2
    """The tokenizer's beginning-of-sequence id (recorded for the export; the model does not read it)."""

    eos_token_id: Union[int, list[int]] = 1
    """The end-of-sequence id(s) (recorded for the export; generation stops at the tokenizer's)."""

    pad_token_id: int = 0
    """The padding id (HF ``text_config.pad_token_id``): the id the image tokens are embedded as before their
    embeddings are replaced (it feeds the per-layer inputs at those positions)."""

    vision_start_token_id: int = 255999
    """The begin-of-image token (HF ``boi_token_id``): an ordinary text token before each image's soft tokens."""

    vision_end_token_id: int = 258882
    """The end-of-image token (HF ``eoi_token_id``): an ordinary text token after each image's soft tokens."""

    image_token_id: int = 258880
    """The image soft token (HF ``image_token_id``): the positions whose embeddings become the images' projected
    soft tokens, in order."""

    use_bidirectional_attention: Optional[str] = None
    """HF ``text_config.use_bidirectional_attention``: None attends causally; ``"vision"`` lets the tokens of one
    image (a run of image tokens) also see the image's later tokens on the sliding-window layers (within the
    window's far edge; the full-attention layers stay causal), as transformers does. ``"all"`` is not
    supported."""

    freeze_language_model: bool = False
    """Train no language-model parameter (``requires_grad=False`` on ``language_model.*``)."""

    freeze_vision_model: bool = False
    """Train no vision-encoder parameter (``vision_tower.*``)."""

    freeze_vision_projection: bool = False
    """Train no projector parameter (``embed_vision.*``)."""

    hf_architecture: ClassVar[str] = "Gemma4ForConditionalGeneration"

    def stage_carries_image_tokens(self) -> bool:
        """With ``use_bidirectional_attention='vision'`` pipeline stages hand on which tokens are image tokens:
        a later stage's sliding-window layers need each image's block and get no token ids."""
        return self.use_bidirectional_attention == "vision"

    def finalize(self) -> None:
        """``Gemma4ModelProvider.finalize``, then the vision fields (one-line errors naming the field)."""
        super().finalize()
        check_gemma4_vision(self)

    def build_model(self, pre_process: bool, post_process: bool, vp_stage: Optional[int],
                    layer_numbers: Optional[list[int]], materialize: bool) -> Any:
        """``longspan.families.gemma4.vl_model.build_gemma4_vl_model`` (see ``ModelProviderMixin``)."""
        from longspan.families.gemma4.vl_model import build_gemma4_vl_model  # keeps the provider free of model code

        check_gemma4_vision(self)
        return build_gemma4_vl_model(self, vp_stage, materialize=materialize, pre_process=pre_process,
                                     post_process=post_process, layer_numbers=layer_numbers)


def check_gemma4_vision(config: Any) -> None:
    """The vision fields of a ``Gemma4VLModelProvider``: one-line errors naming the field."""
    vision = config.vision_config or {}
    for key in _VISION_SIZES:
        value = vision.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model.vision_config.{key}={value!r} is invalid: give a positive integer")
    if vision["num_attention_heads"] % vision["num_key_value_heads"]:
        raise ConfigError(f"model.vision_config.num_attention_heads={vision['num_attention_heads']} is not a multiple "
                          f"of num_key_value_heads={vision['num_key_value_heads']}")
    if vision["head_dim"] % 4:
        raise ConfigError(f"model.vision_config.head_dim={vision['head_dim']} is invalid: the 2-D RoPE needs a "
                          "multiple of 4")
    act = vision.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu"):
        raise NotSupportedError(f"model.vision_config.hidden_activation={act!r} is not supported: use "
                                "gelu_pytorch_tanh, gelu_new or gelu")
    mode = config.use_bidirectional_attention
    if mode not in (None, "vision"):
        raise NotSupportedError(f"model.use_bidirectional_attention={mode!r} is not supported: use null (causal) or "
                                "'vision' (image tokens see each other on the sliding-window layers)")
    rope = (vision.get("rope_parameters") or {}).get("rope_type", "axial")
    if rope != "axial" or vision.get("attention_bias"):
        raise NotSupportedError(f"model.vision_config rope_type={rope!r} / attention_bias="
                                f"{vision.get('attention_bias')!r} is not supported: Gemma 4's encoder uses axial "
                                "RoPE and no attention biases")


__all__ = ["Gemma4VLModelProvider", "check_gemma4_vision"]
