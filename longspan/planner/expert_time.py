"""The time routed experts add to a step beyond their FLOPs, by ``model.moe_grouped_gemm``.

The experts' FLOPs are in the model's FLOPs (``longspan.planner.flops``) and run at the device's achievable
fraction of peak either way. What differs is the work around them, per MoE layer on the rank's pipeline stage,
per microbatch, forward and backward:

- ``moe_grouped_gemm=True``: each projection (fc1, its gate when gated, fc2) is one grouped GEMM forward and two
  backward (input and weight gradient) whatever the number of experts: ``3 * projections`` kernel launches of
  ``KERNEL_LAUNCH_S``. On a CPU ``torch._grouped_mm`` itself loops over the experts, which adds
  ``GROUPED_EXPERT_S[device]`` per local expert.
- ``moe_grouped_gemm=False``: the expert-by-expert loop, ``SEQUENTIAL_EXPERT_S`` per local expert (its ~50 ATen
  calls forward and backward, 8-9 of them kernels, issued one by one from Python after the token counts are
  read on the host).

Where the grouped kernel cannot serve, the run takes the loop and so does the estimate: on a GPU it takes
bfloat16 only (``longspan.models.grouped_gemm.grouped_gemm_unsupported``; every GPU kind the planner knows has
compute capability 8.0 or more), on a CPU float32, bfloat16 or float16, and rows of a multiple of 16 bytes.

Local experts are ``num_moe_experts / expert_model_parallel_size``, so expert parallel divides the loop's cost.
The overhead is added to the compute time, not overlapped with it (on a GPU the device waits for the host once
the experts' GEMMs are small, the case the loop is slow in). The constants were measured on this project's CPU
(one thread, tiny experts so the arithmetic is negligible): the sequential loop ~105 µs per expert, the CPU
grouped kernel ~85 µs; GPU hosts are taken to issue the loop's calls in the same time.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from longspan.planner.flops import routed_expert_layer_flags

#: host seconds to issue one kernel (PyTorch's dispatch and launch): the grouped path's few per projection
KERNEL_LAUNCH_S = 10e-6

#: seconds of one local expert's turn in the sequential loop (forward and backward) beyond its FLOPs
SEQUENTIAL_EXPERT_S = 105e-6

#: seconds per local expert the grouped kernel adds beyond its FLOPs, by device kind (none listed: one kernel per
#: projection whatever the expert count); the CPU's ``torch._grouped_mm`` loops over the experts
GROUPED_EXPERT_S: dict[str, float] = {"cpu": 85e-6}


def grouped_kernel_serves(model: Any, device: str) -> bool:
    """Whether ``torch._grouped_mm`` runs the experts of ``model`` (its ``params_dtype``, hidden and expert widths)
    on a device of kind ``device``; the model falls back to the loop otherwise (see the module docstring)."""
    dtype = model.params_dtype
    allowed = (torch.float32, torch.bfloat16, torch.float16) if device == "cpu" else (torch.bfloat16,)
    if dtype not in allowed:
        return False
    alignment = 16 // torch.empty((), dtype=dtype).element_size()
    widths = (int(model.moe_latent_size or model.hidden_size), int(model.moe_ffn_hidden_size or model.ffn_hidden_size))
    return all(width % alignment == 0 for width in widths)


def expert_overhead_per_layer_s(model: Any, device: str, ep: int) -> float:
    """Seconds one MoE layer's experts add beyond their FLOPs for one microbatch (forward and backward) on a rank
    of expert-parallel size ``ep``, by ``model.moe_grouped_gemm`` (see the module docstring)."""
    local_experts = int(model.num_moe_experts or 0) // ep
    if not local_experts:
        return 0.0
    if not model.moe_grouped_gemm or not grouped_kernel_serves(model, device):
        return local_experts * SEQUENTIAL_EXPERT_S
    projections = 3 if model.gated_linear_unit else 2
    return 3 * projections * KERNEL_LAUNCH_S + local_experts * GROUPED_EXPERT_S.get(device, 0.0)


def expert_overhead_s(cfg: Any, device: str, ep: int, microbatches: int, stage_of_layers: dict[int, int]) -> float:
    """Seconds the experts add to one iteration on the busiest pipeline rank: its MoE layers
    (``stage_of_layers``: layer index -> pipeline rank) times ``microbatches`` times the per-layer overhead."""
    m = cfg.model
    if not m.num_moe_experts:
        return 0.0
    flags = routed_expert_layer_flags(m)
    per_rank = Counter(stage_of_layers[i] for i, is_moe in enumerate(flags) if is_moe)
    layers = max(per_rank.values(), default=0)
    return layers * microbatches * expert_overhead_per_layer_s(m, device, ep)
