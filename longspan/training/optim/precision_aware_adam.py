"""Adam / AdamW whose moments are stored in a chosen dtype: megatron-core's precision-aware optimizer.

Megatron keeps Adam's first and second moments in ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (fp32, fp16 or
bf16) when ``use_precision_aware_optimizer`` is set (TransformerEngine's FusedAdam). Only the storage is low
precision: each step loads the moments, the gradient and the (main) parameter as fp32, computes the update
in fp32 in the same order as ``torch.optim.AdamW`` (single-tensor path), and stores the results back in
their own dtypes. With every dtype fp32 the update is bit for bit torch's.

Gradients are read from ``param.decoupled_grad`` when it is set (a gradient whose dtype differs from the
parameter's, which ``param.grad`` cannot hold: megatron-core's name), else from ``param.grad``.

DTensor parameters (FSDP2 / the distributed optimizer / tensor parallel) work shard by shard: the update is
elementwise, so each rank updates its local shard (a gradient with other placements is redistributed to the
parameter's first) and the moments are DTensors with the parameter's placements (so DCP saves and reshards
them like torch's own optimizer state).
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Iterable

import torch

__all__ = ["PrecisionAwareAdamW", "main_grad", "MOMENT_DTYPES"]

MOMENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def main_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer steps ``param`` with: ``decoupled_grad`` when set, else ``grad``."""
    grad = getattr(param, "decoupled_grad", None)
    return grad if grad is not None else param.grad


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (in-place updates of it update the DTensor), else the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when fp32 (updated in place), else an fp32 copy."""
    return t if t.dtype == torch.float32 else t.float()


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (AdamW) or L2 weight decay, moments stored in chosen dtypes.

    Args:
        params: parameters or param groups (group keys ``lr``, ``betas``, ``eps``, ``weight_decay`` override
            the defaults; other keys are kept, as torch optimizers do).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        decoupled_weight_decay: True is AdamW (decay the weights), False is Adam with the decay added to the
            gradient (``torch.optim.Adam``'s L2 form).
        exp_avg_dtype: storage dtype of the first moment (fp32, fp16 or bf16).
        exp_avg_sq_dtype: storage dtype of the second moment (fp32, fp16 or bf16).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        decoupled_weight_decay: bool = True,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
    ) -> None:
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in MOMENT_DTYPES:
                raise ValueError(f"{name}={dtype} is not one of {MOMENT_DTYPES}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "decoupled_weight_decay": decoupled_weight_decay}
        super().__init__(params, defaults)
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then the moments taken from ``state_dict`` in their own dtypes.

        torch casts floating state to each parameter's dtype, which is not lossless when the parameter is
        fp16 (a main param with ``main_params_dtype`` fp16): bf16/fp32 moments would underflow there.
        """
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        params = chain.from_iterable(group["params"] for group in self.param_groups)
        for saved_id, param in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id, {})
            for key, dtype in (("exp_avg", self.exp_avg_dtype), ("exp_avg_sq", self.exp_avg_sq_dtype)):
                if key in saved:
                    self.state[param][key] = saved[key].to(dtype=dtype, device=param.device)

    def _init_state(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            # A CPU scalar step, as torch's non-capturable Adam keeps it (checkpoints interchange).
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, dtype=self.exp_avg_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.exp_avg_sq_dtype,
                                                   memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            # One tensor at a time, not torch's foreach over the group: the fp32 working copies of a
            # low-precision tensor exist for one tensor only, so peak memory keeps the saving.
            for param in group["params"]:
                grad = main_grad(param)
                if grad is None:
                    continue
                if hasattr(grad, "placements") and grad.placements != param.placements:
                    # e.g. a vocab-parallel embedding's replicated gradient: take this rank's shard of it
                    # (torch's optimizers get the same from DTensor's implicit redistribution).
                    grad = grad.redistribute(param.device_mesh, param.placements)
                state = self._init_state(param)
                state["step"] += 1
                _adam_update(
                    _local(param), _local(grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                    step=state["step"].item(), lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], decoupled=group["decoupled_weight_decay"],
                )
        return loss


def _adam_update(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
    step: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
) -> None:
    """One Adam(W) step of one tensor, computed in fp32 in torch's order; results stored in each dtype."""
    p32, g32, m32, v32 = _fp32(param), _fp32(grad), _fp32(exp_avg), _fp32(exp_avg_sq)
    if weight_decay != 0:
        if decoupled:
            p32.mul_(1 - lr * weight_decay)
        else:
            g32 = g32.add(p32, alpha=weight_decay)
    m32.lerp_(g32, 1 - beta1)
    v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (v32.sqrt() / bias_correction2**0.5).add_(eps)
    p32.addcdiv_(m32, denom, value=-step_size)
    # Store back what was computed on a widened copy (a no-op for fp32 tensors, updated in place).
    for stored, computed in ((param, p32), (exp_avg, m32), (exp_avg_sq, v32)):
        if computed is not stored:
            stored.copy_(computed)
