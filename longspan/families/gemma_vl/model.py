"""Gemma 3's vision-language model (HF ``Gemma3ForConditionalGeneration``) in plain PyTorch.

Each image goes through the SigLIP encoder (``longspan.families.gemma_vl.siglip``); the multimodal projector
average-pools its patch grid to ``mm_tokens_per_image`` vectors, norms them (Gemma's zero-centred RMSNorm) and
projects them to the language model's width. The language model is longspan's ``GPTModel`` (Gemma 3's text
tower): its scaled word embeddings of the prompt are computed, the embeddings at the image-token positions are
replaced by the images' vectors in order, and the decoder runs with a mask where the tokens of one image see
each other in both directions (transformers' ``token_type_ids`` semantics: the tokens of a run of image tokens
form one block; full-attention layers attend causally OR within the block, sliding-window layers also cut the
keys beyond their window). Module names::

    vision_tower.*                             SiglipVisionTower (HF's names)
    multi_modal_projector.mm_input_projection_weight   [vision_hidden, text_hidden] (HF's orientation)
    multi_modal_projector.mm_soft_emb_norm.weight      zero-centred RMSNorm [vision_hidden]
    language_model.*                           GPTModel (embedding, decoder, output layer)

Batches (shared with the data pipeline): ``input_ids`` (longspan's ``tokens``), ``labels``, ``loss_mask``
beside the HF processor's ``pixel_values`` ``[images, channels, size, size]`` (the batch's images in the order
their tokens appear, row by row) and ``token_type_ids`` ``[b, s]`` (1 at image tokens).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longspan.core.errors import DataError, NotSupportedError
from longspan.models.gpt import GPTModel
from longspan.models.init import materialize_model
from longspan.models.sliding_window import TwoSidedMask
from longspan.models.transformer import KVCache
from longspan.families.gemma_vl.siglip import SiglipVisionArgs, SiglipVisionTower


class GemmaRMSNorm(nn.Module):
    """HF's ``Gemma3RMSNorm``: float32 ``x / rms(x) * (1 + weight)``, cast back to the input's dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.init_rule = {"weight": ("zeros", 0.0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Gemma3MultiModalProjector(nn.Module):
    """Patch vectors ``[n, patches, vision_hidden]`` -> image soft tokens ``[n, mm_tokens_per_image, hidden]``:
    average pooling over the patch grid, RMSNorm, then a bias-free projection (HF stores its weight as
    ``[vision_hidden, text_hidden]``, applied as ``x @ weight``)."""

    def __init__(self, vision: SiglipVisionArgs, text_hidden: int, tokens_per_image: int, std: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, text_hidden, dtype=dtype))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps, dtype)
        self.init_rule = {"mm_input_projection_weight": ("normal", std)}
        self.patches_per_side = vision.patches_per_side
        self.kernel = self.patches_per_side // math.isqrt(tokens_per_image)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(n, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid.contiguous(), kernel_size=self.kernel, stride=self.kernel)
        pooled = pooled.flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(patches)


def image_block_ids(token_type_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]``: the index of the image each image token (type 1) belongs to within its row (a run of image
    tokens is one image), -1 for text."""
    is_image = token_type_ids == 1
    starts = is_image & ~F.pad(is_image, (1, 0), value=False)[:, :-1]
    return torch.where(is_image, starts.long().cumsum(dim=1) - 1, torch.full_like(token_type_ids, -1).long())


def image_attention_mask(token_type_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TwoSidedMask:
    """Megatron's bool mask (True = masked) ``[b, 1, s, s]`` over which the tokens of one image also see the
    later tokens of that image: ``attention_mask`` (default causal) unmasked within each image block. Pairs the
    mask blocks both ways (packed documents' block-diagonal mask: two documents) stay masked, so an image's
    block never reaches into another document, even one whose image tokens directly follow."""
    blocks = image_block_ids(token_type_ids)
    same_image = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    s = token_type_ids.shape[1]
    if attention_mask is None:
        attention_mask = torch.ones(s, s, dtype=torch.bool, device=token_type_ids.device).triu(1)[None, None]
    elif attention_mask.dtype != torch.bool:
        attention_mask = attention_mask != 0
    apart = attention_mask & attention_mask.transpose(-1, -2)
    return TwoSidedMask(attention_mask & ~(same_image[:, None] & ~apart))


class Gemma3VLModel(nn.Module):
    """SigLIP encoder + multimodal projector + Gemma 3 language model (see the module docstring)."""

    def __init__(self, config: Any, language_model: GPTModel) -> None:
        super().__init__()
        self.config = config
        self.vision_args = SiglipVisionArgs.from_dict(
            dict(config.vision_config, initializer_range=config.init_method_std))
        dtype = language_model.args.params_dtype
        self.pre_process, self.post_process = language_model.pre_process, language_model.post_process
        # a pipeline's later stages start from the hidden states: the encoder lives on the first stage
        self.vision_tower = SiglipVisionTower(self.vision_args, dtype) if self.pre_process else None
        self.multi_modal_projector = Gemma3MultiModalProjector(
            self.vision_args, config.hidden_size, config.mm_tokens_per_image, config.init_method_std,
            dtype) if self.pre_process else None
        self.language_model = language_model
        self.image_token_id = int(config.image_token_id)
        self.mm_tokens_per_image = int(config.mm_tokens_per_image)

    @property
    def args(self) -> Any:
        """The language model's typed arguments (what generation and conversion read of a model)."""
        return self.language_model.args

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images ``[n, channels, size, size]`` -> their soft tokens ``[n, mm_tokens_per_image, hidden]``."""
        size = self.vision_args.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (self.vision_args.num_channels, size, size):
            raise DataError(f"pixel_values has shape {tuple(pixel_values.shape)}: this model takes images "
                            f"[n, {self.vision_args.num_channels}, {size}, {size}] (the HF processor's output)")
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               pixel_values: torch.Tensor | None) -> torch.Tensor:
        """The language model's embeddings of ``input_ids`` with each image token's replaced by its image's."""
        is_image = input_ids == self.image_token_id
        ids = input_ids
        if self.image_token_id >= self.config.vocab_size:  # an id outside the vocabulary embeds as 0
            ids = input_ids.masked_fill(is_image, 0)
        embeds = self.language_model.embedding(ids, position_ids)
        if pixel_values is None:
            return self._touch_image_parts(embeds)
        features = self.image_features(pixel_values)
        found, wanted = int(is_image.sum()), features.shape[0] * features.shape[1]
        if found != wanted:
            raise DataError(
                f"the batch has {found} image tokens (id {self.image_token_id}) for {features.shape[0]} image(s) "
                f"of mm_tokens_per_image={self.mm_tokens_per_image} tokens each ({wanted}): build the prompt "
                "with the model's processor"
            )
        return embeds.masked_scatter(is_image.unsqueeze(-1), features.to(embeds.dtype))

    def _touch_image_parts(self, embeds: torch.Tensor) -> torch.Tensor:
        """A training batch without images still runs the encoder and projector (on one blank image, its output
        added times 0): every data-parallel rank then reduces the same gradients (zeros here), as HF's and
        LLaVA's trainers do. Nothing changes when they train no parameter or in evaluation."""
        parts = (self.vision_tower, self.multi_modal_projector)
        if not self.training or not any(p.requires_grad for part in parts for p in part.parameters()):
            return embeds
        size = self.vision_args.image_size
        weight = self.vision_tower.embeddings.patch_embedding.weight
        blank = torch.zeros(1, self.vision_args.num_channels, size, size, dtype=weight.dtype, device=embeds.device)
        return embeds + 0.0 * self.image_features(blank).sum().to(embeds.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        loss_mask: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[b, s, padded_vocab]`` (with ``labels``: float32 per-token loss ``[b, s]``), as ``GPTModel``.

        ``pixel_values``: the images whose soft tokens sit at the image-token positions (None: a text-only batch,
        or decoding after the prompt). ``token_type_ids`` (1 = image token) makes each image's tokens attend to
        each other both ways (shorter than ``input_ids``: the tokens after it are text); None attends causally, as
        transformers does without it. ``attention_mask``:
        Megatron's bool mask (True = masked) the image blocks are unmasked in; None = causal. A later pipeline
        stage (``pre_process=False``) takes the previous stage's ``hidden_states`` and the same
        ``token_type_ids`` (its mask); it ignores ``pixel_values``. Other arguments as ``GPTModel.forward``.
        """
        past = kv_cache.seq_len if kv_cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        embeds = self._embed(input_ids, position_ids, pixel_values) if self.pre_process else None
        if token_type_ids is not None and bool((token_type_ids == 1).any()):
            if token_type_ids.shape[1] < input_ids.shape[1]:  # tokens generated after the prompt are text
                token_type_ids = F.pad(token_type_ids, (0, input_ids.shape[1] - token_type_ids.shape[1]))
            if past:
                raise NotSupportedError("token_type_ids after cached tokens are not supported: pass the image "
                                        "tokens in the first forward of a KV cache (the prompt)")
            attention_mask = image_attention_mask(token_type_ids, attention_mask)
        if not self.pre_process:
            return self.language_model(input_ids, position_ids, attention_mask, labels, hidden_states=hidden_states,
                                       kv_cache=kv_cache, loss_mask=loss_mask)
        return self.language_model(input_ids, position_ids, attention_mask, labels, kv_cache=kv_cache,
                                   loss_mask=loss_mask, decoder_input=embeds)


def freeze_parts(model: Gemma3VLModel, config: Any) -> None:
    """``requires_grad=False`` on the parts the provider's ``freeze_*`` fields name."""
    parts = ((config.freeze_language_model, model.language_model),
             (config.freeze_vision_model, model.vision_tower),
             (config.freeze_vision_projection, model.multi_modal_projector))
    for frozen, module in parts:
        if frozen and module is not None:
            for param in module.parameters():
                param.requires_grad_(False)


def build_gemma3_vl_model(provider: Any, vp_stage: int | None = None, *, seed: int | None = None,
                          materialize: bool = True, device: torch.device | str | None = None,
                          pre_process: bool = True, post_process: bool = True,
                          layer_numbers: list[int] | None = None) -> Gemma3VLModel:
    """Build a ``Gemma3VLModel`` (or one pipeline stage of it: ``pre_process`` / ``post_process`` /
    ``layer_numbers`` as ``GPTModel``'s) on the meta device and (by default) materialize and initialize it."""
    with torch.device("meta"):
        model = Gemma3VLModel(provider, GPTModel(provider, pre_process, post_process, vp_stage,
                                                 layer_numbers=layer_numbers))
    freeze_parts(model, provider)
    return materialize_model(model, provider, seed, device) if materialize else model


__all__ = ["Gemma3MultiModalProjector", "Gemma3VLModel", "GemmaRMSNorm", "build_gemma3_vl_model",
           "image_attention_mask", "image_block_ids"]
