"""Gemma 4's MoE block (HF ``enable_moe_block``, the 26B-A4B model): routed experts beside the dense MLP.

Both branches read the residual stream after attention and their normalized outputs are summed (HF's
``Gemma4TextDecoderLayer``)::

    dense  = post_shared_layernorm(shared_experts(pre_shared_layernorm(x)))
    routed = post_experts_layernorm(experts(pre_experts_layernorm(x), router(x)))
    out    = dense + routed                      (the layer then applies post_mlp_layernorm and adds x)

The dense MLP is an expert every token goes through, so it is the shared block's ``shared_experts`` (split over
tensor parallel like a dense MLP by ``longspan.parallel.expert_parallel``); the routed experts are the shared
``GroupedMLP`` (grouped GEMMs with ``moe_grouped_gemm``, sharded by expert parallel) behind the shared token
dispatcher. The router reads the un-normalized residual: a scale-free RMSNorm, times a learned vector ``scale``
and ``1/sqrt(hidden)``, a linear map to the experts, softmax over the chosen top-k (equal to HF's softmax over
all experts renormalized over the top-k), then each weight times its expert's learned ``per_expert_scale``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from longspan.models.args import MoEArgs, TransformerArgs
from longspan.models.moe import MoELayer
from longspan.models.moe_router import TopKRouter, in_backward_pass
from longspan.models.transformer import RMSNorm


class Gemma4Router(TopKRouter):
    """``TopKRouter`` on ``rms_norm(x) * scale / sqrt(hidden)`` whose routing weights are multiplied by the
    chosen experts' ``per_expert_scale``."""

    def __init__(self, hidden_size: int, moe: MoEArgs, init_std: float, dtype: torch.dtype, eps: float) -> None:
        super().__init__(hidden_size, moe, init_std, dtype)
        self.scale = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.per_expert_scale = torch.nn.Parameter(torch.empty(moe.num_experts, dtype=dtype))
        self.init_rule = {"scale": ("ones", 0.0), "per_expert_scale": ("ones", 0.0)}  # HF's init; weight: init_std
        self.eps = eps
        self.root_size = hidden_size**-0.5

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return super().gating(normed * self.scale * self.root_size)

    def routing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        probs, routing_map, tracked = super().routing(logits)
        return probs * self.per_expert_scale.to(probs.dtype), routing_map, tracked


class Gemma4MoE(MoELayer):
    """The MoE layer of a Gemma 4 decoder layer (see the module docstring): ``forward(x [b, s, h])`` takes the
    residual stream, not a normed input."""

    def __init__(self, config: TransformerArgs, layer_number: int) -> None:
        moe = dataclasses.replace(config.moe, shared_ffn_hidden_size=config.ffn_hidden_size, shared_expert_gate=False)
        config = dataclasses.replace(config, moe=moe)
        super().__init__(config, layer_number)
        dtype, eps = config.params_dtype, config.layernorm_epsilon
        self.router = Gemma4Router(config.hidden_size, moe, config.init_method_std, dtype, eps)
        self.reset_metrics()
        self.pre_shared_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.post_shared_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.pre_experts_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.post_experts_layernorm = RMSNorm(config.hidden_size, eps, dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.layer_recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, hidden_states, use_reentrant=False)
        return self._forward(hidden_states)

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        dense = self.post_shared_layernorm(self.shared_experts(self.pre_shared_layernorm(hidden_states)))
        x = hidden_states.reshape(-1, shape[-1])
        probs, routing_map = self.router(x)
        if self.training and torch.is_grad_enabled() and not in_backward_pass():
            self._track(self.router.last_tracked, routing_map)
        routed = self.token_dispatcher.dispatch_and_combine(self.pre_experts_layernorm(x), probs, routing_map,
                                                            self.experts, rows=self.router.routed_rows(x.shape[0]))
        return dense + self.post_experts_layernorm(routed.view(shape))


def gemma4_moe_problem(provider: Any) -> str | None:
    """Why longspan's Gemma 4 MoE block cannot hold ``provider``'s MoE settings (one line), or None."""
    if not provider.num_moe_experts:
        return None
    if provider.moe_layer_freq != 1:
        return f"model.moe_layer_freq={provider.moe_layer_freq!r}: Gemma 4's MoE block is on every layer (1)"
    for name in ("moe_shared_expert_intermediate_size", "moe_latent_size", "moe_shared_expert_gate"):
        if getattr(provider, name, None):
            return (f"model.{name}={getattr(provider, name)!r} is not supported for Gemma 4: its dense MLP is the "
                    "MoE block's shared expert (ffn_hidden_size)")
    return None


__all__ = ["Gemma4MoE", "Gemma4Router", "gemma4_moe_problem"]
