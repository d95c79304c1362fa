"""Gemma 4's vision-language model (HF ``Gemma4ForConditionalGeneration`` with images) in plain PyTorch.

The images go through Gemma 4's vision encoder (``longspan.families.gemma4.vision``) into soft tokens, which
the projector (``embed_vision``) maps to the language model's width. The language model is Gemma 4's text model
(``longspan.families.gemma4.model.Gemma4Model``): the prompt is embedded with each image token replaced by the
pad token, the image tokens' embeddings are replaced by the soft tokens in order, and the per-layer inputs (when
the model has them) take their token part from the pad-substituted ids and their projection from the merged
embeddings, as transformers does. Attention is causal, or with ``use_bidirectional_attention='vision'`` the
tokens of one image also see each other both ways on the sliding-window layers (the full-attention layers stay
causal), as transformers' Gemma 4 does. Module names::

    vision_tower.*                               Gemma4VisionTower (HF's names)
    embed_vision.embedding_projection.weight     [text_hidden, vision_hidden]
    language_model.*                             Gemma4Model (embedding, decoder, output layer)

Batches: ``input_ids`` (longspan's ``tokens``), ``labels``, ``loss_mask`` beside the HF processor's
``pixel_values [images, max_patches, 3 * patch^2]`` and ``image_position_ids [images, max_patches, 2]`` (the
batch's images in the order their tokens appear, row by row).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from longspan.core.errors import DataError, NotSupportedError
from longspan.families.gemma4.model import Gemma4Model
from longspan.families.gemma4.vision import Gemma4VisionArgs, Gemma4VisionEmbedder, Gemma4VisionTower
from longspan.families.gemma_vl.model import image_attention_mask
from longspan.models.init import materialize_model
from longspan.models.sliding_window import TwoSidedMask
from longspan.models.transformer import KVCache


class Gemma4VLModel(nn.Module):
    """Gemma 4 vision encoder + projector + Gemma 4 language model (see the module docstring)."""

    def __init__(self, config: Any, language_model: Gemma4Model) -> None:
        super().__init__()
        self.config = config
        self.vision_args = Gemma4VisionArgs.from_dict(dict(config.vision_config,
                                                           initializer_range=config.init_method_std))
        dtype = language_model.args.params_dtype
        self.pre_process, self.post_process = language_model.pre_process, language_model.post_process
        # a pipeline's later stages start from the hidden states: the encoder lives on the first stage
        self.vision_tower = Gemma4VisionTower(self.vision_args, dtype) if self.pre_process else None
        self.embed_vision = Gemma4VisionEmbedder(
            self.vision_args.hidden_size, config.hidden_size, self.vision_args.rms_norm_eps, config.init_method_std,
            dtype) if self.pre_process else None
        self.language_model = language_model
        self.image_token_id = int(config.image_token_id)
        self.pad_token_id = int(config.pad_token_id)

    @property
    def args(self) -> Any:
        """The language model's typed arguments (what generation and conversion read of a model)."""
        return self.language_model.args

    def image_features(self, pixel_values: torch.Tensor, image_position_ids: torch.Tensor) -> torch.Tensor:
        """The images' soft tokens ``[tokens, hidden]`` (every image's, in order)."""
        patch = self.vision_args.patch_size
        width = 3 * patch * patch
        if pixel_values.dim() != 3 or pixel_values.shape[-1] != width:
            raise DataError(f"pixel_values has shape {tuple(pixel_values.shape)}: this model takes patches "
                            f"[images, max_patches, {width}] (the HF processor's output)")
        if image_position_ids is None or tuple(image_position_ids.shape) != (*pixel_values.shape[:2], 2):
            shape = None if image_position_ids is None else tuple(image_position_ids.shape)
            raise DataError(f"image_position_ids has shape {shape}: give the HF processor's patch positions "
                            f"{(*pixel_values.shape[:2], 2)} with pixel_values")
        return self.embed_vision(self.vision_tower(pixel_values, image_position_ids))

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, pixel_values: torch.Tensor | None,
               image_position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the ids with each image token replaced by the pad token, their embeddings with the image tokens'
        replaced by the images' soft tokens)."""
        is_image = input_ids == self.image_token_id
        ids = input_ids.masked_fill(is_image, self.pad_token_id)
        embeds = self.language_model.embedding(ids, position_ids)
        if pixel_values is None:
            return ids, self._touch_image_parts(embeds)
        features = self.image_features(pixel_values, image_position_ids)
        found = int(is_image.sum())
        if found != features.shape[0]:
            raise DataError(f"the batch has {found} image tokens (id {self.image_token_id}) for the "
                            f"{features.shape[0]} soft tokens of its {pixel_values.shape[0]} image(s): build the "
                            "prompt with the model's processor")
        return ids, embeds.masked_scatter(is_image.unsqueeze(-1), features.to(embeds.dtype))

    def _touch_image_parts(self, embeds: torch.Tensor) -> torch.Tensor:
        """A training batch without images still runs the encoder and projector (on one blank image of one
        soft token, its output added times 0): every data-parallel rank then reduces the same gradients."""
        parts = (self.vision_tower, self.embed_vision)
        if not self.training or not any(p.requires_grad for part in parts for p in part.parameters()):
            return embeds
        k, patch = self.vision_args.pooling_kernel_size, self.vision_args.patch_size
        weight = self.vision_tower.patch_embedder.input_proj.weight
        blank = torch.zeros(1, k * k, 3 * patch * patch, dtype=weight.dtype, device=embeds.device)
        grid = torch.stack(torch.meshgrid(torch.arange(k), torch.arange(k), indexing="xy"), dim=-1)
        positions = grid.reshape(1, k * k, 2).to(embeds.device)
        return embeds + 0.0 * self.image_features(blank, positions).sum().to(embeds.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_position_ids: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
        input_features_mask: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        loss_mask: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[b, s, padded_vocab]`` (with ``labels``: float32 per-token loss ``[b, s]``), as ``GPTModel``.

        ``pixel_values`` / ``image_position_ids``: the HF processor's patches and their grid positions for the
        images whose tokens are in ``input_ids`` (None: text only). ``mm_token_type_ids`` (the processor's)
        is not needed: the image tokens are found by id. Audio (``input_features``) and video
        (``pixel_values_videos``) are refused in one line. A later pipeline stage (``pre_process=False``)
        takes the previous stage's ``hidden_states`` (with ``use_bidirectional_attention='vision'`` they carry
        which tokens are image tokens, for the image blocks' mask); it ignores the image inputs.
        """
        if input_features is not None or input_features_mask is not None:
            raise NotSupportedError("input_features: audio inputs are not supported yet for Gemma 4 "
                                    "(Gemma4ForConditionalGeneration takes images and text in longspan)")
        if pixel_values_videos is not None:
            raise NotSupportedError("pixel_values_videos: video inputs are not supported yet for Gemma 4 "
                                    "(Gemma4ForConditionalGeneration takes images and text in longspan)")
        past = kv_cache.seq_len if kv_cache is not None else 0
        two_way = self.config.use_bidirectional_attention == "vision"
        if not self.pre_process:
            carry = self.language_model.stage_carry
            packed = input_ids if hidden_states is None else hidden_states
            if two_way and carry is not None:  # the first stage's image tokens, handed on in the carry
                attention_mask = self._blocks_of(carry.image_tokens(packed), attention_mask, past)
            return self.language_model(input_ids, position_ids, attention_mask, labels, hidden_states=hidden_states,
                                       kv_cache=kv_cache, loss_mask=loss_mask)
        if position_ids is None:
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        ids, embeds = self._embed(input_ids, position_ids, pixel_values, image_position_ids)
        if two_way:
            attention_mask = self._image_blocks(input_ids, attention_mask, past)
        return self.language_model(ids, position_ids, attention_mask, labels, kv_cache=kv_cache,
                                   loss_mask=loss_mask, decoder_input=embeds,
                                   image_tokens=input_ids == self.image_token_id)

    def _image_blocks(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, past: int) -> Any:
        """The mask over which each image's tokens also see the image's later tokens on the sliding-window
        layers (the full-attention layers keep ``attention_mask``); ``attention_mask`` when there are none."""
        return self._blocks_of(input_ids == self.image_token_id, attention_mask, past)

    def _blocks_of(self, is_image: torch.Tensor, attention_mask: torch.Tensor | None, past: int) -> Any:
        """``_image_blocks`` given which tokens are image tokens (bool ``[b, s]``: a later pipeline stage has
        only that, from the stage carry)."""
        if not bool(is_image.any()):
            return attention_mask
        if past:
            raise NotSupportedError("image tokens after cached tokens are not supported: pass the image tokens "
                                    "in the first forward of a KV cache (the prompt)")
        blocks = image_attention_mask(is_image.long(), attention_mask)
        return TwoSidedMask(blocks.mask, sliding_only=True, full_layers=attention_mask)


def freeze_parts(model: Gemma4VLModel, config: Any) -> None:
    """``requires_grad=False`` on the parts the provider's ``freeze_*`` fields name."""
    parts = ((config.freeze_language_model, model.language_model),
             (config.freeze_vision_model, model.vision_tower),
             (config.freeze_vision_projection, model.embed_vision))
    for frozen, module in parts:
        if frozen and module is not None:
            for param in module.parameters():
                param.requires_grad_(False)


def build_gemma4_vl_model(provider: Any, vp_stage: int | None = None, *, materialize: bool = True,
                          pre_process: bool = True, post_process: bool = True,
                          layer_numbers: list[int] | None = None) -> Gemma4VLModel:
    """Build a ``Gemma4VLModel`` (or one pipeline stage of it) on the meta device and (by default) materialize
    and initialize it."""
    with torch.device("meta"):
        model = Gemma4VLModel(provider, Gemma4Model(provider, pre_process, post_process, vp_stage,
                                                    layer_numbers=layer_numbers))
    freeze_parts(model, provider)
    return materialize_model(model, provider) if materialize else model


__all__ = ["Gemma4VLModel", "build_gemma4_vl_model"]
