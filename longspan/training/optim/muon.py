"""Muon (``optimizer.optimizer='muon'``): orthogonalised momentum on the weight matrices, AdamW on the rest.

Megatron-core's Muon (``TensorParallelMuon`` over Emerging-Optimizers' ``OrthogonalizedOptimizer``), the
Moonlight recipe. The matrices are the 2-D parameters other than the input embedding and the output layer, and
each expert's matrix of a ``[experts, out, in]`` stack (Megatron holds one 2-D weight per expert); everything
else (embeddings, output layer, norms, biases, convolutions) steps with AdamW exactly as ``torch.optim.AdamW``
(``adam_beta1/2``, ``adam_eps``, ``decoupled_weight_decay``). One step of a matrix W with gradient G:

1. decoupled weight decay ``W -= lr * wd * W`` (Megatron's Muon always decouples it);
2. momentum as an EMA ``B = mu * B + (1 - mu) * G`` (``muon_momentum``); the update source is B, or with
   ``muon_use_nesterov`` ``G + mu * (B - G)``;
3. Newton-Schulz: the source over its Frobenius norm (transposed so that rows <= columns), then
   ``muon_num_ns_steps`` quintic steps ``X = a X + (b A + c A A) X`` with ``A = X X^T``, cycling Megatron's five
   'quintic' coefficient sets; in bf16 when ``muon_fp32_matmul_prec='medium'``;
4. times the shape scale of ``muon_scale_mode`` and ``muon_extra_scale_factor``; ``W -= lr * update``.

Projections Megatron fuses into one matrix, which longspan keeps apart, are orthogonalised together as that one
matrix: the gated MLP's gate and up projections (``linear_fc1``), a Mamba mixer's ``in_proj`` segments, and
query/key/value when ``muon_split_qkv`` is False (row order does not change an orthogonalisation).

Sharded parameters (DTensors): a matrix dimension sharded over data-parallel ranks (FSDP2, the distributed
optimizer) is always gathered, so every rank orthogonalises the matrix one process would; over tensor-parallel
ranks it is gathered with ``muon_tp_mode='duplicated'`` and kept with 'blockwise' (each rank's block on its own,
scaled by the block's shape: Megatron's default). An expert dimension is never gathered. This torch has its own
``torch.optim.Muon``, but its update differs (bf16 Newton-Schulz always, Keller Jordan's coefficients, no
scale modes, local tensors only), so it is not used.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.optim.adam import adam as adam_update

from longspan.config.schema.optim import OptimizerConfig

try:  # DTensor is part of torch.distributed; absent only on builds without distributed support.
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["MuonWithAdamW", "QUINTIC_COEFFICIENTS", "is_muon_matrix", "muon_optimizer", "muon_scale", "newton_schulz"]

#: Megatron's 'quintic' Newton-Schulz coefficients (a, b, c), one set per step, cycled.
QUINTIC_COEFFICIENTS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
NS_EPS = 1e-7

#: Mesh dimensions that are tensor parallel (kept local under muon_tp_mode='blockwise').
_TENSOR_PARALLEL_DIMS = ("tp", "etp")
#: Sibling projections Megatron holds as one matrix: (module name, member names in Megatron's row order).
_FUSED_SIBLINGS = (
    ("", ("linear_fc1_gate", "linear_fc1")),
    ("in_proj", ("z", "x", "B", "C", "dt")),
)
_QKV = ("linear_q", "linear_k", "linear_v")


def newton_schulz(matrix: torch.Tensor, steps: int, matmul_precision: str = "medium") -> torch.Tensor:
    """The orthogonalisation of ``matrix`` (the last two dimensions; leading ones are a batch), float32 out."""
    x = matrix.float()
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp_min(NS_EPS)
    if matmul_precision == "medium":
        x = x.bfloat16()  # Megatron's 'medium': bf16 in and out of the matmuls
    with _float32_matmul_precision(matmul_precision):
        for step in range(steps):
            a, b, c = QUINTIC_COEFFICIENTS[step % len(QUINTIC_COEFFICIENTS)]
            gram = x @ x.mT
            x = a * x + (b * gram + c * (gram @ gram)) @ x
    x = x.float()
    return x.mT if transpose else x


def muon_scale(rows: int, cols: int, mode: str) -> float:
    """The factor on the orthogonalised update of a ``rows x cols`` matrix (``muon_scale_mode``)."""
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"muon_scale_mode={mode!r}")


def is_muon_matrix(name: str, param: nn.Parameter, is_embedding_or_output: bool) -> bool:
    """Whether ``param`` steps with Muon: a weight matrix, or a stack of expert matrices (an expert stack's 2-D
    tensors, such as its biases, are vectors per expert, as in Megatron)."""
    if is_embedding_or_output or name.endswith("bias"):
        return False
    return param.dim() == (3 if ".experts." in f".{name}" else 2)


@contextlib.contextmanager
def _float32_matmul_precision(precision: str) -> Iterator[None]:
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def fused_matrix_key(name: str, split_qkv: bool) -> tuple[str, int]:
    """(the key of the matrix ``name`` is part of, its position in it): siblings of one fused matrix share a key."""
    module, _, leaf = name.rpartition(".")
    parent, _, member = module.rpartition(".")
    if leaf == "weight":
        if not split_qkv and member in _QKV:
            return f"{parent}.qkv", _QKV.index(member)
        for container, members in _FUSED_SIBLINGS:
            if member in members and (not container or parent.rpartition(".")[2] == container):
                return f"{parent}.{members[0]}", members.index(member)
    return name, 0


def _is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _orthogonalised_view(t: torch.Tensor, tp_blockwise: bool) -> tuple[torch.Tensor, Callable]:
    """The part of ``t`` this rank orthogonalises, and the function that turns an update of it back into ``t``'s
    layout. Shards of a matrix dimension are gathered (kept over tensor-parallel mesh dimensions when
    ``tp_blockwise``); shards of a leading (expert) dimension stay."""
    if not _is_dtensor(t):
        return t, lambda update: update
    mesh, placements, ndim = t.device_mesh, t.placements, t.dim()
    names = mesh.mesh_dim_names or ()

    def keep(i: int, p: Any) -> bool:
        if not isinstance(p, Shard):
            return False
        if p.dim % ndim < ndim - 2:
            return True
        return tp_blockwise and i < len(names) and names[i] in _TENSOR_PARALLEL_DIMS

    target = [p if keep(i, p) else Replicate() for i, p in enumerate(placements)]
    view = t.redistribute(mesh, target)

    def back(update: torch.Tensor) -> torch.Tensor:
        whole = DTensor.from_local(update, mesh, target, shape=view.shape, stride=view.stride())
        return whole.redistribute(mesh, placements)

    return view.to_local(), back


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the param groups marked ``use_muon``, AdamW (``torch.optim.AdamW``'s update) on the others.

    One torch optimizer, so ``MegatronOptimizer``, the LR scheduler and DCP checkpoints see the usual surface:
    a Muon parameter's state is ``momentum_buffer``, an AdamW one's ``step``/``exp_avg``/``exp_avg_sq``.

    Args:
        param_groups: Megatron's param groups, each with ``use_muon``.
        config: the run's ``OptimizerConfig`` (the ``muon_*`` and ``adam_*`` fields).
        fused_keys: per group, per parameter, :func:`fused_matrix_key` of its name (positions, since
            ``MegatronOptimizer`` swaps low-precision parameters for fp32 copies in place).
        foreach: torch's foreach AdamW kernels for the AdamW groups.
    """

    def __init__(self, param_groups: list[dict], config: OptimizerConfig,
                 fused_keys: list[list[tuple[str, int]]], foreach: bool = False) -> None:
        defaults = dict(lr=config.lr, weight_decay=config.weight_decay, use_muon=False,
                        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                        decoupled_weight_decay=bool(config.decoupled_weight_decay),
                        momentum=config.muon_momentum, nesterov=bool(config.muon_use_nesterov))
        super().__init__(param_groups, defaults)
        self.fused_keys = fused_keys
        self.num_ns_steps = int(config.muon_num_ns_steps)
        self.scale_mode = config.muon_scale_mode
        self.extra_scale_factor = float(config.muon_extra_scale_factor)
        self.matmul_precision = config.muon_fp32_matmul_prec
        self.tp_blockwise = config.muon_tp_mode == "blockwise"
        self.foreach = foreach

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sources: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}
        for index, group in enumerate(self.param_groups):
            if not group["use_muon"]:
                self._adamw(group)
                continue
            for param, (key, order) in zip(group["params"], self.fused_keys[index]):
                if param.grad is not None:
                    sources.setdefault(key, []).append((order, param, self._momentum(group, param), group["lr"]))
        for members in sources.values():
            self._orthogonalised_update(sorted(members, key=lambda m: m[0]))
        return loss

    def _momentum(self, group: dict, param: torch.Tensor) -> torch.Tensor:
        """Weight decay, then the momentum buffer's EMA; returns what Newton-Schulz orthogonalises."""
        grad = param.grad
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        if wd > 0.0:
            param.add_(param, alpha=-lr * wd)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1.0 - mu)
        return grad.lerp(buf, mu) if group["nesterov"] else buf

    def _orthogonalised_update(self, members: list[tuple[int, torch.Tensor, torch.Tensor, float]]) -> None:
        """Orthogonalise the members' sources as one matrix (stacked along rows) and step each member."""
        views, backs = zip(*(_orthogonalised_view(source, self.tp_blockwise) for _, _, source, _ in members))
        matrix = views[0] if len(views) == 1 else torch.cat(views, dim=-2)
        update = newton_schulz(matrix, self.num_ns_steps, self.matmul_precision)
        update = update * (muon_scale(matrix.size(-2), matrix.size(-1), self.scale_mode) * self.extra_scale_factor)
        pieces = torch.split(update, [v.size(-2) for v in views], dim=-2)
        for (_, param, _, lr), piece, back in zip(members, pieces, backs):
            param.add_(back(piece.to(param.dtype).contiguous()), alpha=-lr)

    def _adamw(self, group: dict) -> None:
        """``torch.optim.AdamW``'s step of one group (its state layout and functional kernel)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam_update(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=self.foreach,
            decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=False, beta1=beta1, beta2=beta2,
            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


def muon_optimizer(config: OptimizerConfig, model_chunks: list[nn.Module], param_groups: list[dict],
                   is_embedding_or_output: Callable[[str, nn.Parameter], bool],
                   fast_kernels: Callable[[list[nn.Parameter]], dict[str, bool]]) -> MuonWithAdamW:
    """Muon over ``param_groups`` (Megatron's), AdamW on their embedding/output and non-matrix parameters with
    the foreach kernels when ``fast_kernels`` allows any fast kernel for them."""
    groups, fused_keys = muon_param_groups(model_chunks, param_groups, config, is_embedding_or_output)
    adamw = [p for g in groups if not g["use_muon"] for p in g["params"]]
    foreach = bool(adamw) and any(fast_kernels(adamw).values())
    return MuonWithAdamW(groups, config, fused_keys, foreach)


def muon_param_groups(model_chunks: list[nn.Module], param_groups: list[dict], config: OptimizerConfig,
                      is_embedding_or_output: Callable[[str, nn.Parameter], bool],
                      ) -> tuple[list[dict], list[list[tuple[str, int]]]]:
    """Each Megatron param group split into its Muon part and its AdamW part (the same lr/wd keys), with the
    fused-matrix keys of the Muon parts' parameters."""
    names: dict[int, str] = {}
    for chunk_index, chunk in enumerate(model_chunks):
        for name, param in chunk.named_parameters():
            names.setdefault(id(param), f"{chunk_index}/{name}")
    groups: list[dict] = []
    keys: list[list[tuple[str, int]]] = []
    for group in param_groups:
        muon, adamw = [], []
        for param in group["params"]:
            name = names[id(param)].partition("/")[2]
            (muon if is_muon_matrix(name, param, is_embedding_or_output(name, param)) else adamw).append(param)
        for use_muon, params in ((True, muon), (False, adamw)):
            if params:
                groups.append({**group, "params": params, "use_muon": use_muon})
                keys.append([fused_matrix_key(names[id(p)], bool(config.muon_split_qkv)) if use_muon else ("", 0)
                             for p in params])
    return groups, keys
