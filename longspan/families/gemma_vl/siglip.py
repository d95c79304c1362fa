"""SigLIP's vision transformer (the image encoder of Gemma 3's vision-language model), in plain PyTorch.

An image ``[b, channels, size, size]`` is cut into ``(size / patch)^2`` patches by a strided convolution, each
patch gets a learned position embedding, and pre-norm encoder layers (LayerNorm, bidirectional multi-head
attention with biases, LayerNorm, a tanh-GeLU MLP) run over the patches; a final LayerNorm gives one vector per
patch. Module names are transformers' ``SiglipVisionModel``'s, so the weight table maps them one to one::

    embeddings.patch_embedding                 nn.Conv2d [hidden, channels, patch, patch] (+ bias)
    embeddings.position_embedding              nn.Embedding [patches, hidden]
    encoder.layers.{i}.layer_norm1 / layer_norm2                        nn.LayerNorm (+ bias)
    encoder.layers.{i}.self_attn.q_proj / k_proj / v_proj / out_proj    nn.Linear (+ bias)
    encoder.layers.{i}.mlp.fc1 / fc2                                    nn.Linear (+ bias)
    post_layernorm                             nn.LayerNorm (+ bias)

Gemma 3 uses every patch vector (``vision_use_head=false``): SigLIP's attention-pooling head is not built.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: HF ``hidden_act`` values of the vision MLP -> ``F.gelu``'s ``approximate``
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class SiglipVisionArgs:
    """The vision tower's shape: HF ``SiglipVisionConfig``'s field names (``vision_config`` of config.json)."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 896
    patch_size: int = 14
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    """The std of the weights' random init (SigLIP's own init differs; imports overwrite every weight)."""

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "SiglipVisionArgs":
        """The arguments from a ``vision_config`` dict (keys it does not know are ignored)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in known})

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def _linear(inputs: int, outputs: int, std: float, dtype: torch.dtype) -> nn.Linear:
    layer = nn.Linear(inputs, outputs, bias=True, dtype=dtype)
    layer.init_std = std
    return layer


class SiglipEmbeddings(nn.Module):
    """Patches by a strided convolution, plus one learned position embedding per patch."""

    def __init__(self, args: SiglipVisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(args.num_channels, args.hidden_size, kernel_size=args.patch_size,
                                         stride=args.patch_size, padding="valid", dtype=dtype)
        self.patch_embedding.init_std = args.initializer_range
        self.position_embedding = nn.Embedding(args.patches_per_side ** 2, args.hidden_size, dtype=dtype)
        self.position_embedding.init_std = args.initializer_range

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [b, patches, hidden], row-major over the grid
        positions = torch.arange(patches.shape[1], device=patches.device)
        return patches + self.position_embedding(positions)[None]


class SiglipAttention(nn.Module):
    """Bidirectional multi-head self-attention over the patches (biases on every projection)."""

    def __init__(self, args: SiglipVisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, std = args.hidden_size, args.initializer_range
        self.num_heads = args.num_attention_heads
        self.dropout = args.attention_dropout
        self.q_proj = _linear(hidden, hidden, std, dtype)
        self.k_proj = _linear(hidden, hidden, std, dtype)
        self.v_proj = _linear(hidden, hidden, std, dtype)
        self.out_proj = _linear(hidden, hidden, std, dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        q, k, v = (proj(hidden_states).view(b, s, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, -1))


class SiglipMLP(nn.Module):
    def __init__(self, args: SiglipVisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.approximate = GELU_APPROXIMATIONS[args.hidden_act]
        self.fc1 = _linear(args.hidden_size, args.intermediate_size, args.initializer_range, dtype)
        self.fc2 = _linear(args.intermediate_size, args.hidden_size, args.initializer_range, dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(hidden_states), approximate=self.approximate))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, args: SiglipVisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps, dtype=dtype)
        self.self_attn = SiglipAttention(args, dtype)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps, dtype=dtype)
        self.mlp = SiglipMLP(args, dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states))
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class SiglipEncoder(nn.Module):
    def __init__(self, args: SiglipVisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(args, dtype) for _ in range(args.num_hidden_layers))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


class SiglipVisionTower(nn.Module):
    """Images ``[n, channels, image_size, image_size]`` -> patch vectors ``[n, patches, hidden]``."""

    def __init__(self, args: SiglipVisionArgs, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args = args
        self.embeddings = SiglipEmbeddings(args, dtype)
        self.encoder = SiglipEncoder(args, dtype)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


__all__ = ["GELU_APPROXIMATIONS", "SiglipVisionArgs", "SiglipVisionTower"]
