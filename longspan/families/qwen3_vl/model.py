"""Qwen3-VL: the vision encoder (``vision``), its patch merger (``merger``) and DeepStack mergers
(``deepstack_mergers``) feeding longspan's GPT language model (a Qwen3 decoder, dense or with experts; for
Qwen3.5, the gated DeltaNet hybrid and no DeepStack).

The forward embeds the tokens, puts the merger's outputs at the image tokens (``image_token_id``) and video tokens
(``video_token_id``), numbers the positions with interleaved mRoPE (``positions``) and runs the language model.
DeepStack: the features of the encoder blocks in ``deepstack_visual_indexes`` (each through its own merger) are
added to the hidden states at the image and video positions after decoder layers 0, 1, ... (one layer per
feature). They travel with the embeddings: the decoder input is ``[embeddings | feature 0 | feature 1 | ...]``
along the hidden dimension (each feature zero off the vision tokens), so whatever cuts the sequence before the
first layer (sequence parallel, context parallel's load-balanced chunks) cuts the features alike; a forward
pre-hook on layer 0 takes them off its input, and forward hooks on layers 0, 1, ... add them to the outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from longspan.config.rules.model import check_mrope_model
from longspan.core.errors import ConfigError, DataError, NotSupportedError
from longspan.families.qwen3_vl.positions import InterleavedMultimodalRotaryEmbedding, qwen3_vl_position_ids
from longspan.families.qwen3_vl.vision import PatchMerger, Qwen3VisionArgs, Qwen3VisionModel
from longspan.families.qwen_vl.model import language_config
from longspan.models.gpt import GPTModel
from longspan.models.transformer import KVCache


class Qwen3VLModel(nn.Module):
    """Qwen3-VL (HF ``Qwen3VLForConditionalGeneration`` / ``Qwen3VLMoeForConditionalGeneration``, and Qwen3.5's
    ``Qwen3_5(Moe)ForConditionalGeneration``) built from a ``Qwen3VLModelProvider`` or a subclass;
    ``pre_process`` / ``post_process`` / ``vp_stage`` / ``layer_numbers`` are the language model's (see
    ``GPTModel``); the encoder and mergers live on the first stage."""

    def __init__(self, config: Any, pre_process: bool = True, post_process: bool = True,
                 vp_stage: int | None = None, layer_numbers: list[int] | None = None) -> None:
        super().__init__()
        self.config = config
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        if config.position_embedding_type != "mrope":
            raise ConfigError(f"model.position_embedding_type={config.position_embedding_type!r}: Qwen3-VL "
                              "numbers its positions with mRoPE: leave it 'mrope'")
        check_mrope_model(config)
        self.vision_args = args = Qwen3VisionArgs.from_dict(config.vision_config)
        if args.out_hidden_size != config.hidden_size:
            raise ConfigError(f"model.vision_config.out_hidden_size={args.out_hidden_size} must equal "
                              f"model.hidden_size={config.hidden_size} (the mergers feed the language model)")
        self.deepstack_layers = list(range(len(args.deepstack_visual_indexes)))
        _check_deepstack_layout(config, self.deepstack_layers, pre_process, layer_numbers)
        dtype = config.params_dtype or torch.float32
        self.vision = Qwen3VisionModel(args).to(dtype) if pre_process else None
        self.merger = PatchMerger(args).to(dtype) if pre_process else None
        self.deepstack_mergers = nn.ModuleList(
            PatchMerger(args, postshuffle_norm=True) for _ in args.deepstack_visual_indexes
        ).to(dtype) if pre_process else None
        self.language_model = GPTModel(language_config(config), pre_process, post_process, vp_stage,
                                       layer_numbers=layer_numbers)
        # the rotating part of each head (Qwen3.5: a quarter)
        rotating = int(self.language_model.args.kv_channels * config.rotary_percent)
        self.language_model.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(
            rotating, config.mrope_section, rotary_base=config.rotary_base)
        # this rank's DeepStack features of the forward in progress ([b, local s, hidden] each), taken off layer
        # 0's input by its pre-hook and added by the layers' hooks
        self._deepstack: list[torch.Tensor] | None = None
        self.deepstack_hooks = []  # the layers' adding hooks
        if pre_process and self.deepstack_layers:
            layers = self.language_model.decoder.layers
            layers["0"].register_forward_pre_hook(self._take_features)
            self.deepstack_hooks = [layers[str(index)].register_forward_hook(self.deepstack_hook(index))
                                    for index in self.deepstack_layers]

    def _take_features(self, module: nn.Module, args: tuple) -> tuple | None:
        """Layer 0's pre-hook: split a widened input into the hidden states and the DeepStack features."""
        hidden = args[0]
        width = self.config.hidden_size
        if hidden.shape[-1] == width:
            self._deepstack = None
            return None
        pieces = hidden.split(width, dim=-1)
        self._deepstack = list(pieces[1:])
        return (pieces[0], *args[1:])

    def deepstack_hook(self, index: int) -> Any:
        """The forward hook of the decoder layer that takes DeepStack feature ``index``."""
        def add_features(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
            if self._deepstack is None:
                return None
            return output + self._deepstack[index].to(output.dtype)

        return add_features

    def visual_embeddings(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
                          ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The LM embeddings of a batch's images (or videos) ``[tokens, hidden]`` and their DeepStack features
        (one ``[tokens, hidden]`` per DeepStack layer, in order)."""
        patches, taps = self.vision(pixel_values, grid_thw)
        order = sorted(self.vision_args.deepstack_visual_indexes)
        features = [self.deepstack_mergers[self.vision_args.deepstack_visual_indexes.index(block)](tap)
                    for block, tap in zip(order, taps)]
        return self.merger(patches), features

    def _touch_image_parts(self, embeddings: torch.Tensor) -> torch.Tensor:
        """A training batch without images still runs the encoder and mergers on one blank merged patch (added
        times 0), so every data-parallel rank reduces the same gradients (zeros here)."""
        parts = (self.vision, self.merger, self.deepstack_mergers)
        if not self.training or not any(p.requires_grad for part in parts for p in part.parameters()):
            return embeddings
        args = self.vision_args
        merge = args.spatial_merge_size
        width = args.in_channels * args.temporal_patch_size * args.patch_size ** 2
        weight = self.vision.patch_embed.proj.weight
        blank = torch.zeros(merge * merge, width, dtype=weight.dtype, device=embeddings.device)
        merged, features = self.visual_embeddings(blank, torch.tensor([[1, merge, merge]], device=embeddings.device))
        total = merged.sum() + sum(f.sum() for f in features)
        return embeddings + 0.0 * total.to(embeddings.dtype)

    def mrope_positions(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                        video_grid_thw: torch.Tensor | None, kv_cache: KVCache | None) -> torch.Tensor:
        """Position ids ``[3, b, s]``: from the tokens, images and videos, or, for tokens after a cached prompt,
        the text numbering shifted by the prompt's ``rope_deltas`` (kept on the cache)."""
        past = kv_cache.seq_len if kv_cache is not None else 0
        if past and kv_cache.rope_deltas is not None:
            batch, seq = input_ids.shape
            text = torch.arange(past, past + seq, device=input_ids.device).view(1, 1, seq).expand(3, batch, seq)
            return text + kv_cache.rope_deltas.to(input_ids.device)
        positions, deltas = qwen3_vl_position_ids(input_ids, image_grid_thw, video_grid_thw,
                                                  self.config.image_token_id, self.config.video_token_id,
                                                  self.vision_args.spatial_merge_size)
        if kv_cache is not None:
            kv_cache.rope_deltas = deltas
        return positions + past

    def _put_in(self, embeddings: torch.Tensor, input_ids: torch.Tensor, token_id: int, pixels: torch.Tensor,
                grid: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """``embeddings`` with the merged embeddings of ``pixels`` at the ``token_id`` tokens; (that, the
        tokens' mask, their DeepStack features)."""
        merged, features = self.visual_embeddings(pixels, grid)
        mask = input_ids == token_id
        count = int(mask.sum())
        if count != merged.shape[0]:
            raise DataError(f"the tokens hold {count} tokens {token_id} but {what} ({grid.tolist()} patch grids) "
                            f"make {merged.shape[0]}: one token per merged patch")
        embeddings = embeddings.masked_scatter(mask.unsqueeze(-1), merged.to(embeddings.dtype))
        return embeddings, mask, features

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        loss_mask: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the model (or this pipeline stage): ``GPTModel.forward``'s contract, plus the images and videos
        (the HF processor's ``pixel_values`` / ``image_grid_thw`` and ``pixel_values_videos`` /
        ``video_grid_thw``; one token per merged patch, a video's frames in order). ``position_ids``: ``[3, b, s]``
        mRoPE ids, None computes them. ``cu_seqlens``: packed documents' boundaries, for the language model's
        gated DeltaNet layers (Qwen3.5), whose state restarts at each. A mismatch between the vision tokens and the
        inputs is a one-line ``DataError``."""
        if not self.pre_process:
            return self.language_model(input_ids, position_ids, attention_mask, labels, hidden_states=hidden_states,
                                       kv_cache=kv_cache, loss_mask=loss_mask, cu_seqlens=cu_seqlens)
        for pixels, grid, names in ((pixel_values, image_grid_thw, "pixel_values came without image_grid_thw"),
                                    (pixel_values_videos, video_grid_thw,
                                     "pixel_values_videos came without video_grid_thw")):
            if pixels is not None and grid is None:
                raise DataError(f"{names}: pass the processor's grid with its pixels")
        if position_ids is None:
            position_ids = self.mrope_positions(input_ids, image_grid_thw, video_grid_thw, kv_cache)
        embeddings = self.language_model.embedding(input_ids, None)
        parts = []
        if pixel_values is not None:
            embeddings, *part = self._put_in(embeddings, input_ids, self.config.image_token_id, pixel_values,
                                             image_grid_thw, "pixel_values")
            parts.append(part)
        if pixel_values_videos is not None:
            embeddings, *part = self._put_in(embeddings, input_ids, self.config.video_token_id, pixel_values_videos,
                                             video_grid_thw, "pixel_values_videos")
            parts.append(part)
        if not parts:
            embeddings = self._touch_image_parts(embeddings)
        if parts and self.deepstack_layers:
            embeddings = torch.cat([embeddings, *_deepstack_features(parts, embeddings)], dim=-1)
        return self.language_model(input_ids, position_ids, attention_mask, labels, kv_cache=kv_cache,
                                   loss_mask=loss_mask, decoder_input=embeddings, cu_seqlens=cu_seqlens)


def _deepstack_features(parts: list[list[Any]], embeddings: torch.Tensor) -> list[torch.Tensor]:
    """Per DeepStack layer, ``[b, s, hidden]``: the image and video tokens' features at their places, zeros
    elsewhere (``parts``: (tokens' mask, features per layer) of the images, then of the videos)."""
    out = []
    for level in range(len(parts[0][1])):
        feature = torch.zeros_like(embeddings)
        for mask, features in parts:
            feature = feature.masked_scatter(mask.unsqueeze(-1), features[level].to(embeddings.dtype))
        out.append(feature)
    return out


def _check_deepstack_layout(config: Any, layers: list[int], pre_process: bool,
                            layer_numbers: list[int] | None) -> None:
    """The layouts the DeepStack hooks serve: the decoder layers that take features on the first stage, no
    recompute of whole layers (it would rerun the later DeepStack layers after the forward, their hooks then
    reading another microbatch's features)."""
    if not layers:
        return
    here = set(layers if layer_numbers is None else layer_numbers) & set(layers)
    if here != (set(layers) if pre_process else set()):
        raise NotSupportedError(f"the pipeline split puts Qwen3-VL's DeepStack layers {layers} off the first "
                                "stage: give the first stage at least that many layers")
    if config.recompute_granularity == "full":
        raise NotSupportedError("model.recompute_granularity='full' is not supported yet for Qwen3-VL (its "
                                "DeepStack layers would be recomputed without their features): use 'selective'")


def freeze(model: Qwen3VLModel, language_model: bool, vision_model: bool, vision_projection: bool) -> None:
    """Megatron Bridge's freeze options: ``requires_grad=False`` on the language model, the encoder, or the
    projections into the language model (the merger and the DeepStack mergers)."""
    parts = [(language_model, model.language_model), (vision_model, model.vision),
             (vision_projection, model.merger), (vision_projection, model.deepstack_mergers)]
    for chosen, module in parts:
        if chosen and module is not None:
            for param in module.parameters():
                param.requires_grad_(False)
