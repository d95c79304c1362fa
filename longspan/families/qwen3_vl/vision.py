"""Qwen3-VL's vision encoder in plain PyTorch: patch embedding plus learned position embeddings interpolated to each
image's grid, ViT blocks with 2-D RoPE over whole frames, the patch merger and the DeepStack mergers.

Inputs are the HF image (or video) processor's outputs, as for Qwen2.5-VL (``longspan.families.qwen_vl.vision``):
``pixel_values [patches, channels * temporal_patch * patch * patch]`` in 2x2 merge-block order and ``grid_thw
[images, 3]``. The differences from Qwen2.5-VL: LayerNorms with biases, a plain (not gated) MLP, a bias on the
patch embedding, a learned ``num_position_embeddings`` grid of position embeddings resampled bilinearly (corners
aligned) to each image's patch grid, no window attention (every block attends over one frame), and DeepStack: the
outputs of the blocks in ``deepstack_visual_indexes`` each go through their own merger (LayerNorm after the 2x2
concatenation) and are added to the language model's hidden states after its first layers.

Module names are transformers' (``patch_embed.proj``, ``pos_embed``, ``blocks.{i}.norm1 / attn.qkv / attn.proj /
norm2 / mlp.linear_fc1 / mlp.linear_fc2``, ``merger.norm / linear_fc1 / linear_fc2``,
``deepstack_merger_list.{j}.*``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.families.qwen_vl.vision import VisionAttention, VisionPatchEmbed, image_seqlens, patch_positions
from longspan.models.rope import default_inv_freq

NORM_EPS = 1e-6  # the encoder's and the mergers' LayerNorms

_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


@dataclass(frozen=True)
class Qwen3VisionArgs:
    """The vision encoder's shape: HF ``Qwen3VLVisionConfig``'s field names and defaults."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0
    initializer_range: float = 0.02

    @classmethod
    def from_dict(cls, config: Any) -> "Qwen3VisionArgs":
        """From a ``vision_config`` dict or an HF ``Qwen3VLVisionConfig`` (unknown keys ignored)."""
        config = dict(config.to_dict() if hasattr(config, "to_dict") else config or {})
        rope = config.get("rope_parameters") or {}
        if "rope_theta" not in config and "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names and v is not None}
        if "deepstack_visual_indexes" in kwargs:
            kwargs["deepstack_visual_indexes"] = tuple(int(i) for i in kwargs["deepstack_visual_indexes"])
        args = cls(**kwargs)
        args.check(rope.get("rope_type", "axial"))
        return args

    def check(self, rope_type: str = "axial") -> None:
        """One-line ``ConfigError`` / ``NotSupportedError`` naming the first bad ``model.vision_config`` entry."""
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(f"model.vision_config.hidden_size={self.hidden_size} must be num_heads={self.num_heads}"
                              " heads of a size divisible by 4 (2-D RoPE splits each head between rows and columns)")
        if self.hidden_act not in _ACTIVATIONS:
            raise NotSupportedError(f"model.vision_config.hidden_act={self.hidden_act!r} is not supported: use "
                                    f"one of {sorted(_ACTIVATIONS)}")
        if rope_type != "axial":
            raise NotSupportedError(f"model.vision_config.rope_parameters.rope_type={rope_type!r} is not supported: "
                                    "Qwen3-VL's encoder has 'axial' 2-D RoPE")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ConfigError(f"model.vision_config.num_position_embeddings={self.num_position_embeddings} must be a "
                              "square (the learned position grid is side x side)")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ConfigError(f"model.vision_config.deepstack_visual_indexes={list(self.deepstack_visual_indexes)}: "
                              f"{bad} are not blocks of a depth-{self.depth} encoder")


def _linear(d_in: int, d_out: int, std: float) -> nn.Linear:
    layer = nn.Linear(d_in, d_out)
    layer.init_std = std
    return layer


class VisionMLP(nn.Module):
    """``linear_fc2(act(linear_fc1(x)))`` with biases."""

    def __init__(self, args: Qwen3VisionArgs) -> None:
        super().__init__()
        self.linear_fc1 = _linear(args.hidden_size, args.intermediate_size, args.initializer_range)
        self.linear_fc2 = _linear(args.intermediate_size, args.hidden_size, args.initializer_range)
        self.act = _ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm ViT block: LayerNorm, attention (Qwen2.5-VL's, within each frame), residual; LayerNorm, MLP,
    residual."""

    def __init__(self, args: Qwen3VisionArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=NORM_EPS)
        self.attn = VisionAttention(args)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=NORM_EPS)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], rotary: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, rotary)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each group of ``spatial_merge_size**2`` consecutive patches -> one language-model embedding: LayerNorm
    (per patch, or over the concatenation when ``postshuffle_norm``: the DeepStack mergers), Linear-GELU-Linear."""

    def __init__(self, args: Qwen3VisionArgs, postshuffle_norm: bool = False) -> None:
        super().__init__()
        self.merged_size = args.hidden_size * args.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_size if postshuffle_norm else args.hidden_size, eps=NORM_EPS)
        self.linear_fc1 = _linear(self.merged_size, self.merged_size, args.initializer_range)
        self.linear_fc2 = _linear(self.merged_size, args.out_hidden_size, args.initializer_range)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(patches.reshape(-1, self.merged_size))
        else:
            x = self.norm(patches).reshape(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def interpolated_positions(table: torch.Tensor, grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """The learned ``[side * side, hidden]`` position table resampled to each grid (bilinear, corners aligned),
    in the processor's patch order (2x2 merge blocks, every frame alike) ``[patches, hidden]``."""
    side = math.isqrt(table.shape[0])
    square = table.view(side, side, -1).permute(2, 0, 1).unsqueeze(0).float()
    out = []
    for t, h, w in grids:
        grid = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
        blocks = grid.view(-1, h // merge, merge, w // merge, merge).permute(1, 3, 2, 4, 0)
        out.append(blocks.reshape(h * w, -1).repeat(t, 1))
    return torch.cat(out).to(table.dtype)


class Qwen3VisionModel(nn.Module):
    """The encoder without the mergers: ``pixel_values``, ``grid_thw`` -> (the last block's patch features
    ``[patches, hidden]``, the features after each block of ``deepstack_visual_indexes``, in block order; the
    mergers, ``PatchMerger``, are modules of the vision-language model)."""

    def __init__(self, args: Qwen3VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = VisionPatchEmbed(args, bias=True)  # Qwen3-VL's patch projection has a bias
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.pos_embed.init_std = args.initializer_range
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [patches, 2]`` -> ``(cos, sin)`` ``[patches, 1, head_dim]``: row frequencies, then column
        frequencies (a quarter of the head each), twice (the rotate-half layout)."""
        head_dim = self.args.hidden_size // self.args.num_heads
        inv = default_inv_freq(head_dim // 2, self.args.rope_theta).to(positions.device)
        half = (positions.float().unsqueeze(-1) * inv).flatten(1)
        emb = torch.cat((half, half), dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grids = [tuple(int(n) for n in g) for g in grid_thw.tolist()]
        merge = self.args.spatial_merge_size
        x = self.patch_embed(pixel_values)
        x = x + interpolated_positions(self.pos_embed.weight, grids, merge).to(x.dtype)
        rotary = self.rotary_tables(patch_positions(grids, merge, x.device))
        seqlens = image_seqlens(grids)
        taps = []
        for i, block in enumerate(self.blocks):
            x = block(x, seqlens, rotary)
            if i in self.args.deepstack_visual_indexes:
                taps.append(x)
        return x, taps
