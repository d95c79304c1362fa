"""Qwen2.5-VL: the vision encoder and patch merger (``vision``) feeding longspan's GPT language model.

Plain PyTorch, three submodules for parallel plans to address::

    vision            QwenVisionTransformer  patch_embed.proj, blocks.{i}.(norm1, attn.qkv, attn.proj, norm2, mlp.*)
    merger            PatchMerger            ln_q, mlp.0, mlp.2 (2x2 patches -> one LM embedding)
    language_model    GPTModel               the Qwen2 decoder; its rotary table is mRoPE (``mrope``)

The forward embeds the tokens, replaces the embeddings of the image tokens (``image_token_id``, one per merged
patch, in order) with the merger's outputs, numbers the positions with mRoPE (from the tokens and the images'
patch grids, as transformers' ``get_rope_index``, unless given) and runs the language model. Sequence and context
parallel split the sequence inside the language model, after this merge and numbering (``longspan.parallel``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from longspan.config.rules.model import check_mrope_model
from longspan.core.errors import ConfigError, DataError
from longspan.models.gpt import GPTModel
from longspan.models.transformer import KVCache
from longspan.models.vlm.mrope import MultimodalRotaryEmbedding, mrope_position_ids
from longspan.families.qwen_vl.vision import PatchMerger, QwenVisionArgs, QwenVisionTransformer


def language_config(config: Any) -> Any:
    """The provider as its language model sees it: plain RoPE (the model swaps in the mRoPE table)."""
    text = copy.copy(config)
    text.position_embedding_type = "rope"
    return text


class Qwen25VLModel(nn.Module):
    """Qwen2.5-VL (HF ``Qwen2_5_VLForConditionalGeneration``) built from a ``Qwen25VLModelProvider``.

    ``pre_process`` / ``post_process`` / ``vp_stage`` / ``layer_numbers`` are the language model's (see
    ``GPTModel``); the vision encoder and merger live on the first stage."""

    def __init__(self, config: Any, pre_process: bool = True, post_process: bool = True,
                 vp_stage: int | None = None, layer_numbers: list[int] | None = None) -> None:
        super().__init__()
        self.config = config
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        if config.position_embedding_type != "mrope":
            raise ConfigError(f"model.position_embedding_type={config.position_embedding_type!r}: Qwen2.5-VL "
                              "numbers its positions with mRoPE: leave it 'mrope'")
        check_mrope_model(config)
        self.vision_args = QwenVisionArgs.from_dict(config.vision_config)
        if self.vision_args.out_hidden_size != config.hidden_size:
            raise ConfigError(f"model.vision_config.out_hidden_size={self.vision_args.out_hidden_size} must equal "
                              f"model.hidden_size={config.hidden_size} (the merger feeds the language model)")
        dtype = config.params_dtype or torch.float32
        self.vision = QwenVisionTransformer(self.vision_args).to(dtype) if pre_process else None
        self.merger = PatchMerger(self.vision_args).to(dtype) if pre_process else None
        self.language_model = GPTModel(language_config(config), pre_process, post_process, vp_stage,
                                       layer_numbers=layer_numbers)
        self.language_model.rotary_pos_emb = MultimodalRotaryEmbedding(
            self.language_model.args.kv_channels, config.mrope_section, rotary_base=config.rotary_base)

    def image_embeddings(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """The LM embeddings of a batch's images ``[image tokens, hidden]``, image after image."""
        return self.merger(self.vision(pixel_values, image_grid_thw))

    def _touch_image_parts(self, embeddings: torch.Tensor) -> torch.Tensor:
        """A training batch without images still runs the encoder and merger (on one blank merged patch, its
        output added times 0): every data-parallel rank then reduces the same gradients (zeros here), as HF's
        and LLaVA's trainers do. Nothing changes when they train no parameter or in evaluation."""
        parts = (self.vision, self.merger)
        if not self.training or not any(p.requires_grad for part in parts for p in part.parameters()):
            return embeddings
        args = self.vision_args
        merge = args.spatial_merge_size
        width = args.in_channels * args.temporal_patch_size * args.patch_size ** 2
        weight = self.vision.patch_embed.proj.weight
        blank = torch.zeros(merge * merge, width, dtype=weight.dtype, device=embeddings.device)
        grid = torch.tensor([[1, merge, merge]], device=embeddings.device)
        return embeddings + 0.0 * self.image_embeddings(blank, grid).sum().to(embeddings.dtype)

    def mrope_positions(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                        kv_cache: KVCache | None) -> torch.Tensor:
        """Position ids ``[3, b, s]``: from the tokens and images, or, for tokens after a cached prompt, the
        text numbering shifted by the prompt's ``rope_deltas`` (kept on the cache)."""
        past = kv_cache.seq_len if kv_cache is not None else 0
        if past and kv_cache.rope_deltas is not None:
            batch, seq = input_ids.shape
            text = torch.arange(past, past + seq, device=input_ids.device).view(1, 1, seq).expand(3, batch, seq)
            return text + kv_cache.rope_deltas.to(input_ids.device)
        positions, deltas = mrope_position_ids(input_ids, image_grid_thw, self.config.image_token_id,
                                               self.vision_args.spatial_merge_size)
        if kv_cache is not None:
            kv_cache.rope_deltas = deltas
        return positions + past

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        loss_mask: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the model (or this pipeline stage): ``GPTModel.forward``'s contract, plus the images.

        Args:
            input_ids: token ids ``[b, s]``; each image is ``image_token_id`` repeated once per merged patch.
            position_ids: ``[3, b, s]`` mRoPE ids (a ``[b, s]`` tensor numbers all three axes alike); None
                computes them from ``input_ids`` and ``image_grid_thw``.
            pixel_values: the HF image processor's ``pixel_values`` ``[patches, C * T * P * P]`` of the batch's
                images, in order; None for a text-only batch.
            image_grid_thw: the processor's ``image_grid_thw`` ``[images, 3]``.
            attention_mask, labels, kv_cache, loss_mask, hidden_states: as ``GPTModel.forward``.

        A mismatch between the image tokens and the images is a one-line ``DataError``.
        """
        if not self.pre_process:
            return self.language_model(input_ids, position_ids, attention_mask, labels, hidden_states=hidden_states,
                                       kv_cache=kv_cache, loss_mask=loss_mask)
        if pixel_values is not None and image_grid_thw is None:
            raise DataError("pixel_values came without image_grid_thw: pass the image processor's image_grid_thw")
        if position_ids is None:
            position_ids = self.mrope_positions(input_ids, image_grid_thw, kv_cache)
        embeddings = self.language_model.embedding(input_ids, None)
        if pixel_values is not None:
            images = self.image_embeddings(pixel_values, image_grid_thw)
            is_image = input_ids == self.config.image_token_id
            count = int(is_image.sum())
            if count != images.shape[0]:
                raise DataError(f"the tokens hold {count} image tokens but the images ({image_grid_thw.tolist()} "
                                f"patch grids) make {images.shape[0]}: one image token per merged patch")
            embeddings = embeddings.masked_scatter(is_image.unsqueeze(-1), images.to(embeddings.dtype))
        else:
            embeddings = self._touch_image_parts(embeddings)
        return self.language_model(input_ids, position_ids, attention_mask, labels, kv_cache=kv_cache,
                                   loss_mask=loss_mask, decoder_input=embeddings)


def freeze(model: Qwen25VLModel, language_model: bool, vision_model: bool, vision_projection: bool) -> None:
    """Stop the gradients of the chosen parts (Megatron Bridge's freeze options): their parameters get
    ``requires_grad=False``, so the optimizer leaves them as they are."""
    parts = [(language_model, model.language_model), (vision_model, model.vision),
             (vision_projection, model.merger)]
    for chosen, module in parts:
        if chosen and module is not None:
            for param in module.parameters():
                param.requires_grad_(False)
