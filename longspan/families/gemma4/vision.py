"""Gemma 4's vision encoder (transformers' ``Gemma4VisionModel``) and its projector, in plain PyTorch.

The HF processor cuts each image into ``patch_size``-pixel patches (``pixel_values [n, max_patches, 3 * p * p]``,
padded to the processor's budget) and gives each patch its ``(x, y)`` grid position (``image_position_ids
[n, max_patches, 2]``, ``(-1, -1)`` for padding). The encoder:

- embeds the patches (``2 * (pixels - 0.5)`` through a bias-free linear) and adds a learned embedding of ``x``
  plus one of ``y`` (``position_embedding_table [2, position_embedding_size, hidden]``, zero on padding);
- runs bidirectional layers over the real patches (padding keys masked): per-head RMSNorm on queries and keys
  (with weights) and on values (without), 2-D RoPE (the first half of each head rotates with ``x``, the second
  with ``y``, ``rope_theta``), softmax scale 1, grouped KV heads; RMSNorm before and after attention and the
  gated MLP; every linear optionally clamps its input and output (``use_clipped_linears``: four buffers each);
- average-pools each ``pooling_kernel_size``-square of patches into one soft token (by grid position), multiplies
  by ``sqrt(hidden)`` in float32, drops the padding slots, and (``standardize``) maps ``(x - std_bias) *
  std_scale``.

The projector (``embed_vision``) is a weightless RMSNorm and a bias-free linear to the language model's width.
Module names are transformers', so the weight table maps them one to one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from longspan.core.errors import DataError
from longspan.families.gemma_vl.siglip import GELU_APPROXIMATIONS


@dataclass(frozen=True)
class Gemma4VisionArgs:
    """The encoder's shape: HF ``Gemma4VisionConfig``'s field names (``vision_config`` of config.json)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    attention_dropout: float = 0.0
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    rope_theta: float = 100.0
    initializer_range: float = 0.02
    """The std of the weights' random init (imports overwrite every weight)."""

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "Gemma4VisionArgs":
        """The arguments from a ``vision_config`` dict (keys it does not know are ignored)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in config.items() if k in known}
        rope = config.get("rope_parameters") or {}
        if "rope_theta" in rope:
            values["rope_theta"] = float(rope["rope_theta"])
        return cls(**values)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)


class VisionRMSNorm(nn.Module):
    """HF's ``Gemma4RMSNorm``: float32 ``x / rms(x)`` (times ``weight`` when it has one), cast back."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype)) if with_scale else None
        self.init_rule = {"weight": ("ones", 0.0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _rms(x.float(), self.eps)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


class ClippableLinear(nn.Module):
    """A bias-free ``linear``; with clipping, its input and output clamped to ``[input_min, input_max]`` and
    ``[output_min, output_max]`` (persistent scalar buffers, unbounded until a checkpoint sets them)."""

    _BOUNDS = ("input_min", "input_max", "output_min", "output_max")

    def __init__(self, inputs: int, outputs: int, args: Gemma4VisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = nn.Linear(inputs, outputs, bias=False, dtype=dtype)
        self.linear.init_std = args.initializer_range
        self.clipped = args.use_clipped_linears
        if self.clipped:
            for name in self._BOUNDS:
                self.register_buffer(name, torch.tensor(math.inf if name.endswith("max") else -math.inf))

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> "ClippableLinear":
        was_meta = self.clipped and self.input_min.is_meta
        super()._apply(fn, recurse)
        if was_meta and not self.input_min.is_meta:  # to_empty() of a meta-built model: unbounded, HF's init
            for name in self._BOUNDS:
                getattr(self, name).fill_(math.inf if name.endswith("max") else -math.inf)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        x = self.linear(x)
        if self.clipped:
            x = torch.clamp(x, self.output_min, self.output_max)
        return x


def rope_2d(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """``x [n, p, heads, d]`` rotated by the patches' ``positions [n, p, 2]``: the first ``d/2`` channels by
    ``x`` and the last by ``y``, each half as plain RoPE (rotate-half) over its ``d/4`` frequencies."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=x.device) / half))
    parts = []
    for axis in range(2):
        angles = positions[..., axis, None].float() * inv_freq  # [n, p, d/4]
        angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        part = x[..., axis * half:(axis + 1) * half]
        first, second = part.chunk(2, dim=-1)
        parts.append(part * cos + torch.cat([-second, first], dim=-1) * sin)
    return torch.cat(parts, dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, args: Gemma4VisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, d = args.hidden_size, args.head_dim
        self.heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, d
        self.theta, self.dropout = args.rope_theta, args.attention_dropout
        self.q_proj = ClippableLinear(hidden, self.heads * d, args, dtype)
        self.k_proj = ClippableLinear(hidden, self.kv_heads * d, args, dtype)
        self.v_proj = ClippableLinear(hidden, self.kv_heads * d, args, dtype)
        self.o_proj = ClippableLinear(self.heads * d, hidden, args, dtype)
        self.q_norm = VisionRMSNorm(d, args.rms_norm_eps, dtype)
        self.k_norm = VisionRMSNorm(d, args.rms_norm_eps, dtype)
        self.v_eps = args.rms_norm_eps

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        n, p, _ = x.shape
        q = rope_2d(self.q_norm(self.q_proj(x).view(n, p, self.heads, -1)), positions, self.theta)
        k = rope_2d(self.k_norm(self.k_proj(x).view(n, p, self.kv_heads, -1)), positions, self.theta)
        v = _rms(self.v_proj(x).view(n, p, self.kv_heads, -1).float(), self.v_eps).type_as(x)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :], scale=1.0,
                                             dropout_p=self.dropout if self.training else 0.0,
                                             enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(n, p, -1))


class VisionMLP(nn.Module):
    def __init__(self, args: Gemma4VisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.approximate = GELU_APPROXIMATIONS[args.hidden_activation]
        self.gate_proj = ClippableLinear(args.hidden_size, args.intermediate_size, args, dtype)
        self.up_proj = ClippableLinear(args.hidden_size, args.intermediate_size, args, dtype)
        self.down_proj = ClippableLinear(args.intermediate_size, args.hidden_size, args, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate=self.approximate) * self.up_proj(x))


class VisionEncoderLayer(nn.Module):
    def __init__(self, args: Gemma4VisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = VisionAttention(args, dtype)
        self.mlp = VisionMLP(args, dtype)
        self.input_layernorm = VisionRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = VisionRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = VisionRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = VisionRMSNorm(hidden, eps, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, keep))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nn.Module):
    def __init__(self, args: Gemma4VisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(args, dtype) for _ in range(args.num_hidden_layers))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, positions, keep)
        return x


class PatchEmbedder(nn.Module):
    def __init__(self, args: Gemma4VisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * args.patch_size ** 2, args.hidden_size, bias=False, dtype=dtype)
        self.input_proj.init_std = args.initializer_range
        self.position_embedding_table = nn.Parameter(
            torch.empty(2, args.position_embedding_size, args.hidden_size, dtype=dtype))
        self.init_rule = {"position_embedding_table": ("normal", args.initializer_range)}

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        hidden = self.input_proj((2 * (pixels - 0.5)).to(self.input_proj.weight.dtype))
        clamped = positions.clamp(min=0)
        table = self.position_embedding_table
        where = F.embedding(clamped[..., 0], table[0]) + F.embedding(clamped[..., 1], table[1])
        return hidden + torch.where(padding[..., None], 0.0, where)


class Gemma4VisionTower(nn.Module):
    """Patches ``[n, max_patches, 3 * p * p]`` and their positions -> the images' soft tokens ``[tokens,
    hidden]`` (all images' real tokens in order) in the encoder's dtype."""

    def __init__(self, args: Gemma4VisionArgs, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args = args
        self.patch_embedder = PatchEmbedder(args, dtype)
        self.encoder = VisionEncoder(args, dtype)
        if args.standardize:
            self.register_buffer("std_bias", torch.zeros(args.hidden_size, dtype=dtype))
            self.register_buffer("std_scale", torch.ones(args.hidden_size, dtype=dtype))

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> "Gemma4VisionTower":
        was_meta = self.args.standardize and self.std_bias.is_meta
        super()._apply(fn, recurse)
        if was_meta and not self.std_bias.is_meta:  # to_empty() of a meta-built model: the identity
            self.std_bias.zero_()
            self.std_scale.fill_(1.0)
        return self

    def forward(self, pixel_values: torch.Tensor, image_position_ids: torch.Tensor) -> torch.Tensor:
        k = self.args.pooling_kernel_size
        check_pooled_grids(image_position_ids, k)
        padding = (image_position_ids == -1).all(dim=-1)
        hidden = self.patch_embedder(pixel_values, image_position_ids, padding)
        hidden = self.encoder(hidden, image_position_ids, ~padding)
        pooled, real = self._pool(hidden.masked_fill(padding[..., None], 0.0), image_position_ids,
                                  pixel_values.shape[-2] // (k * k))
        tokens = pooled[real]
        if self.args.standardize:
            tokens = (tokens - self.std_bias.float()) * self.std_scale.float()
        return tokens.to(hidden.dtype)

    def _pool(self, hidden: torch.Tensor, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Average of each ``k x k`` square of patches (by grid position) into ``length`` slots, times
        sqrt(hidden), in float32; and which slots hold a real square."""
        scale = self.args.hidden_size ** 0.5
        if hidden.shape[1] == length:
            return hidden.float() * scale, ~(positions == -1).all(dim=-1)
        k = self.args.pooling_kernel_size
        clamped = positions.clamp(min=0)
        width = clamped[..., 0].max(dim=-1, keepdim=True)[0] + 1
        slot = torch.div(clamped, k, rounding_mode="floor")
        slot = slot[..., 0] + (width // k) * slot[..., 1]
        weights = F.one_hot(slot.long(), length).float() / (k * k)
        pooled = (weights.transpose(1, 2) @ hidden.float()).to(hidden.dtype)
        return pooled.float() * scale, ~(weights == 0).all(dim=1)


def check_pooled_grids(image_position_ids: torch.Tensor, kernel: int, where: str = "image_position_ids") -> None:
    """Each image's patch grid (from its positions) must be at least ``kernel`` patches on each side and a
    multiple of it, so that it pools into whole soft tokens: a one-line DataError otherwise."""
    real = ~(image_position_ids == -1).all(dim=-1)
    for i in range(image_position_ids.shape[0]):
        grid = image_position_ids[i][real[i]]
        width, height = ((int(grid[:, a].max()) + 1) if grid.numel() else 0 for a in range(2))
        if width < kernel or height < kernel or width % kernel or height % kernel:
            raise DataError(f"{where}: image {i + 1} is {width}x{height} patches, too small or uneven for the "
                            f"{kernel}x{kernel} pooling of one soft token (each side a multiple of {kernel}): "
                            "resize it with the model's processor")


class Gemma4VisionEmbedder(nn.Module):
    """HF's ``Gemma4MultimodalEmbedder`` for images: weightless RMSNorm, then a bias-free projection to the
    language model's width."""

    def __init__(self, vision_hidden: int, text_hidden: int, eps: float, std: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Linear(vision_hidden, text_hidden, bias=False, dtype=dtype)
        self.embedding_projection.init_std = std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(_rms(x.float(), self.eps).type_as(x))


__all__ = ["Gemma4VisionArgs", "Gemma4VisionEmbedder", "Gemma4VisionTower", "check_pooled_grids"]
