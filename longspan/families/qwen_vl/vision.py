"""Qwen2.5-VL's vision encoder in plain PyTorch: patch embedding, ViT blocks with window attention and 2-D RoPE,
and the patch merger that turns each 2x2 block of patches into one language-model token.

Inputs are the HF image processor's outputs: ``pixel_values [patches, channels * temporal_patch * patch *
patch]`` (the patches of every image of the batch, one after the other) and ``image_grid_thw [images, 3]``
(each image's patch grid: frames, rows, columns). Patches are ordered in 2x2 merge blocks (the processor's
order), so every 4 consecutive patches become one token.

Window attention: most blocks attend within windows of ``window_size`` pixels (square windows of merge
blocks); the blocks in ``fullatt_block_indexes`` attend over the whole image. Attention never crosses images.

Module names are transformers' (``patch_embed.proj``, ``blocks.{i}.norm1 / attn.qkv / attn.proj / norm2 /
mlp.gate_proj / up_proj / down_proj``; merger ``ln_q``, ``mlp.0``, ``mlp.2``), as Megatron Bridge keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.rope import apply_rotary, default_inv_freq
from longspan.models.transformer import RMSNorm

VISION_NORM_EPS = 1e-6  # Qwen2.5-VL's vision norms and the merger's ln_q


@dataclass(frozen=True)
class QwenVisionArgs:
    """The vision encoder's shape: HF ``Qwen2_5_VLVisionConfig``'s field names, its defaults (the released
    models' encoder)."""

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    out_hidden_size: int = 3584
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    tokens_per_second: int = 4
    initializer_range: float = 0.02

    @classmethod
    def from_dict(cls, config: Any) -> "QwenVisionArgs":
        """From a ``vision_config`` dict, or an HF ``Qwen2_5_VLVisionConfig`` as Megatron Bridge's provider holds
        (HF's names; unknown keys ignored: HF configs carry many generic ones)."""
        config = dict(config.to_dict() if hasattr(config, "to_dict") else config or {})
        rope = config.get("rope_parameters") or {}
        if "rope_theta" not in config and "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names and v is not None}
        if "fullatt_block_indexes" in kwargs:
            kwargs["fullatt_block_indexes"] = tuple(int(i) for i in kwargs["fullatt_block_indexes"])
        args = cls(**kwargs)
        args.check()
        return args

    def check(self) -> None:
        """One-line ``ConfigError`` / ``NotSupportedError`` naming the first bad ``model.vision_config`` entry."""
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.vision_config.hidden_size={self.hidden_size} must be a multiple of "
                              f"num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(f"model.vision_config: the head size {self.hidden_size // self.num_heads} must be a "
                              "multiple of 4 (2-D RoPE splits it between rows and columns)")
        if self.hidden_act not in _ACTIVATIONS:
            raise NotSupportedError(f"model.vision_config.hidden_act={self.hidden_act!r} is not supported: use "
                                    f"one of {sorted(_ACTIVATIONS)}")
        if self.window_size % (self.spatial_merge_size * self.patch_size):
            raise ConfigError(f"model.vision_config.window_size={self.window_size} must be a multiple of "
                              f"spatial_merge_size * patch_size = {self.spatial_merge_size * self.patch_size}")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ConfigError(f"model.vision_config.fullatt_block_indexes={list(self.fullatt_block_indexes)}: "
                              f"{bad} are not blocks of a depth-{self.depth} encoder")


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _linear(d_in: int, d_out: int, std: float, bias: bool = True) -> nn.Linear:
    layer = nn.Linear(d_in, d_out, bias=bias)
    layer.init_std = std
    return layer


class VisionPatchEmbed(nn.Module):
    """Each patch (``temporal_patch x patch x patch`` pixels per channel) -> a ``hidden_size`` vector (a Conv3d
    whose stride is its kernel, i.e. one linear map per patch, as HF has it)."""

    def __init__(self, args: QwenVisionArgs, bias: bool = False) -> None:
        super().__init__()
        self.kernel = (args.temporal_patch_size, args.patch_size, args.patch_size)
        self.in_channels = args.in_channels
        self.proj = nn.Conv3d(args.in_channels, args.hidden_size, kernel_size=self.kernel, stride=self.kernel,
                              bias=bias)
        self.proj.init_std = args.initializer_range

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = pixel_values.view(-1, self.in_channels, *self.kernel).to(self.proj.weight.dtype)
        return self.proj(patches).view(patches.shape[0], -1)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention within each segment of ``cu_seqlens`` (a window, or a whole image)."""

    def __init__(self, args: QwenVisionArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.head_dim = args.hidden_size // args.num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = _linear(args.hidden_size, 3 * args.hidden_size, args.initializer_range)
        self.proj = _linear(args.hidden_size, args.hidden_size, args.initializer_range)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], rotary: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [n, heads, d]
        cos, sin = rotary
        q = apply_rotary(q.float(), cos, sin).to(v.dtype)  # in float32, as HF rotates
        k = apply_rotary(k.float(), cos, sin).to(v.dtype)
        lengths = [end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        outputs = []
        for qs, ks, vs in zip(*(t.transpose(0, 1).unsqueeze(0).split(lengths, dim=2) for t in (q, k, v))):
            outputs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=self.scale))
        out = torch.cat(outputs, dim=2)[0].transpose(0, 1).reshape(n, -1)
        return self.proj(out)


class VisionMLP(nn.Module):
    """Gated MLP with biases: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, args: QwenVisionArgs) -> None:
        super().__init__()
        std = args.initializer_range
        self.gate_proj = _linear(args.hidden_size, args.intermediate_size, std)
        self.up_proj = _linear(args.hidden_size, args.intermediate_size, std)
        self.down_proj = _linear(args.intermediate_size, args.hidden_size, std)
        self.act = _ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm ViT block: RMSNorm, attention, residual; RMSNorm, gated MLP, residual."""

    def __init__(self, args: QwenVisionArgs) -> None:
        super().__init__()
        self.norm1 = RMSNorm(args.hidden_size, eps=VISION_NORM_EPS)
        self.attn = VisionAttention(args)
        self.norm2 = RMSNorm(args.hidden_size, eps=VISION_NORM_EPS)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], rotary: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, rotary)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """The projector: RMSNorm per patch, then each group of ``spatial_merge_size**2`` consecutive patches
    concatenated and mapped by Linear-GELU-Linear to one language-model embedding."""

    def __init__(self, args: QwenVisionArgs) -> None:
        super().__init__()
        self.merged_size = args.hidden_size * args.spatial_merge_size**2
        self.ln_q = RMSNorm(args.hidden_size, eps=VISION_NORM_EPS)
        self.mlp = nn.Sequential(_linear(self.merged_size, self.merged_size, args.initializer_range), nn.GELU(),
                                 _linear(self.merged_size, args.out_hidden_size, args.initializer_range))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(patches).view(-1, self.merged_size))


def patch_positions(grid_thw: list[tuple[int, int, int]], merge: int, device: torch.device) -> torch.Tensor:
    """(row, column) of every patch ``[patches, 2]``, in the processor's order (2x2 merge blocks, row-major)."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h, device=device).view(h, 1).expand(h, w)
        cols = torch.arange(w, device=device).view(1, w).expand(h, w)
        blocks = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(blocks).transpose(1, 2).flatten()
        cols = cols.reshape(blocks).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_order(grid_thw: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks reordered window by window, and the windows' boundaries in patches.

    ``window`` is the window's side in merge blocks. Returns ``(order, cu_seqlens)``: ``order[j]`` is the merge
    block at place j (windows row-major over each frame, blocks row-major inside a window; edge windows are
    smaller), ``cu_seqlens`` the cumulative patch counts of the windows (starting at 0)."""
    order, cu_seqlens, offset = [], [0], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        ids = torch.arange(t * gh * gw).view(t, gh, gw) + offset
        for frame in ids:
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    block = frame[r:r + window, c:c + window].reshape(-1)
                    order.append(block)
                    cu_seqlens.append(cu_seqlens[-1] + block.numel() * merge * merge)
        offset += t * gh * gw
    return torch.cat(order), cu_seqlens


def image_seqlens(grid_thw: list[tuple[int, int, int]]) -> list[int]:
    """Cumulative patch counts of the frames (full attention spans one frame of one image)."""
    cu = [0]
    for t, h, w in grid_thw:
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu


class QwenVisionTransformer(nn.Module):
    """The encoder without the merger: ``pixel_values``, ``grid_thw`` -> patch features ``[patches, hidden]``
    in the input's patch order (the merger, ``PatchMerger``, is a separate module of the VLM)."""

    def __init__(self, args: QwenVisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = VisionPatchEmbed(args)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))
        # 2-D RoPE: half of the head's frequencies per axis (rows, then columns); the whole head rotates
        self.axis_rot_dim = args.hidden_size // args.num_heads // 2

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [patches, 2]`` -> ``(cos, sin)`` ``[patches, 1, head_dim]`` (row freqs | column freqs,
        twice: the rotate-half layout)."""
        inv = default_inv_freq(self.axis_rot_dim, self.args.rope_theta).to(positions.device)
        freqs = positions.float().unsqueeze(-1) * inv  # [patches, 2, head_dim / 4]
        half = freqs.flatten(1)
        emb = torch.cat((half, half), dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        args = self.args
        grids = [tuple(int(n) for n in g) for g in grid_thw.tolist()]
        unit = args.spatial_merge_size**2
        order, window_seqlens = window_order(grids, args.spatial_merge_size,
                                             args.window_size // args.spatial_merge_size // args.patch_size)
        order = order.to(pixel_values.device)
        full_seqlens = image_seqlens(grids)

        def to_windows(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, unit, *t.shape[1:])[order].reshape(t.shape)

        x = to_windows(self.patch_embed(pixel_values))
        cos, sin = self.rotary_tables(patch_positions(grids, args.spatial_merge_size, x.device))
        rotary = (to_windows(cos), to_windows(sin))
        for i, block in enumerate(self.blocks):
            x = block(x, full_seqlens if i in args.fullatt_block_indexes else window_seqlens, rotary)
        restore = torch.argsort(order)
        return x.reshape(-1, unit, x.shape[-1])[restore].reshape(x.shape)
