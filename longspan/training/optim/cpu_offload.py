"""Optimizer CPU offload (``optimizer.optimizer_cpu_offload``): part of the optimizer on the host.

Megatron's ``HybridDeviceOptimizer``: the first parameters in param-group order, until
``optimizer_offload_fraction`` of the elements are reached, get a float32 copy in host memory; their
optimizer state lives next to that copy and their update runs there, on the CPU, with torch's own optimizer.
Each step copies their gradients to the host (device to host), steps both parts, and copies the updated
host parameters back (host to device). The rest steps where it lives, as without offload.

A sharded parameter (FSDP2, the distributed optimizer, tensor parallel) offloads this rank's shard: the host
copy is the local shard, and ``state`` shows the host state laid out as DTensors like the parameter, so
checkpoints stay sharded. On a CPU-only machine the host copies are still separate tensors and the offloaded part still steps on its
own, so the path runs and is tested everywhere. Pinned host buffers (``pin_cpu_params``, ``pin_cpu_grads``)
and copies on a side stream (``overlap_cpu_optimizer_d2h_h2d``) apply only with CUDA.

A parameter changed outside the optimizer (weights loaded from a checkpoint without the optimizer state,
main params rebuilt from the model) is noticed through its version counter and its host copy refreshed
before the next update. ``state`` and ``param_groups`` are keyed by the original parameters, so checkpoints
are the same as without offload.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from longspan.config.schema.optim import OptimizerConfig
from longspan.core.errors import NotSupportedError

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch builds without distributed support
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["CpuOffloadOptimizer", "offload_optimizer", "offloaded_parameters"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, else ``t`` itself."""
    return t._local_tensor if DTensor is not None and isinstance(t, DTensor) else t


def offloaded_parameters(params: list[torch.Tensor], fraction: float) -> list[torch.Tensor]:
    """Megatron's choice: parameters in order while fewer than ``fraction`` of this rank's elements (its shards
    of sharded parameters) are offloaded."""
    threshold = fraction * sum(_local(p).numel() for p in params)
    chosen, count = [], 0
    for param in params:
        if count < threshold:
            chosen.append(param)
            count += _local(param).numel()
    return chosen


class CpuOffloadOptimizer(torch.optim.Optimizer):
    """One optimizer over ``param_groups`` whose offloaded part steps on host copies.

    Args:
        param_groups: Megatron-style param groups (``params`` plus per-group hyperparameters).
        make_optimizer: builds a torch optimizer from param groups; called once for the device part and once
            for the host part (same hyperparameters).
        fraction: share of the elements offloaded (``optimizer_offload_fraction``).
        pin_params, pin_grads: pin the host copies / host gradient buffers (CUDA only).
        overlap_copies: issue the copies on a side CUDA stream (CUDA only).
    """

    def __init__(self, param_groups: list[dict[str, Any]],
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer], fraction: float,
                 pin_params: bool = True, pin_grads: bool = True, overlap_copies: bool = False) -> None:
        super().__init__(param_groups, defaults={})
        params = [p for group in self.param_groups for p in group["params"]]
        cuda = torch.cuda.is_available()
        self._pin_grads = pin_grads and cuda
        self._async_h2d = pin_params and cuda  # copies from pinned host memory may run asynchronously
        self._stream = torch.cuda.Stream() if overlap_copies and cuda else None
        self.host_copy: dict[torch.Tensor, torch.Tensor] = {}
        for param in offloaded_parameters(params, fraction):  # a sharded parameter: a copy of this rank's shard
            local = _local(param)
            host = torch.empty(local.shape, dtype=torch.float32, device="cpu", pin_memory=pin_params and cuda)
            host.copy_(local.detach())
            self.host_copy[param] = host
        self._seen_version = {param: _local(param)._version for param in self.host_copy}
        self.host_steps = 0  # updates the host part has made

        def split(on_host: bool) -> list[dict[str, Any]]:
            groups = []
            for group in self.param_groups:
                chosen = [self.host_copy[p] if on_host else p for p in group["params"]
                          if (p in self.host_copy) == on_host]
                if chosen:
                    groups.append({**_hyperparameters(group), "params": chosen})
            return groups

        device_groups, host_groups = split(False), split(True)
        self.device_optimizer = make_optimizer(device_groups) if device_groups else None
        self.host_optimizer = make_optimizer(host_groups) if host_groups else None
        self._share_state()

    # ------------------------------------------------------------------ stepping
    def _sync_hyperparameters(self) -> None:
        """Copy each group's lr / weight decay (set by the scheduler on this optimizer) to the parts."""
        for part in (self.device_optimizer, self.host_optimizer):
            if part is None:
                continue
            for part_group in part.param_groups:
                owner = self._group_of(part_group["params"][0])
                part_group.update(_hyperparameters(owner))

    def _group_of(self, tensor: torch.Tensor) -> dict[str, Any]:
        original = self._original.get(tensor, tensor)
        for group in self.param_groups:
            if any(p is original for p in group["params"]):
                return group
        raise KeyError("parameter not in any group")  # pragma: no cover - the groups were split from these

    def _refresh_changed_params(self) -> None:
        """Host copies of parameters written outside the optimizer since its last update."""
        for param, host in self.host_copy.items():
            local = _local(param)
            if local._version != self._seen_version[param]:
                host.copy_(local.detach())
                self._seen_version[param] = local._version

    def _copy_grads_to_host(self) -> None:
        for param, host in self.host_copy.items():
            if param.grad is None:
                host.grad = None
                continue
            if host.grad is None:
                host.grad = torch.empty(host.shape, dtype=torch.float32, device="cpu", pin_memory=self._pin_grads)
            host.grad.copy_(_local(param.grad), non_blocking=self._pin_grads)

    def _copy_params_to_device(self) -> None:
        with torch.no_grad():
            for param, host in self.host_copy.items():
                local = _local(param)
                local.copy_(host, non_blocking=self._async_h2d)
                self._seen_version[param] = local._version

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Update both parts: gradients to the host, both steps, updated parameters back to the device."""
        if closure is not None:
            raise NotSupportedError("a closure is not supported with optimizer.optimizer_cpu_offload=True")
        self._sync_hyperparameters()
        self._refresh_changed_params()
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._copy_grads_to_host()
        else:
            self._copy_grads_to_host()
        if self.device_optimizer is not None:
            self.device_optimizer.step()
        if self.host_optimizer is not None:
            if stream is not None:
                stream.synchronize()
            elif self._pin_grads:
                torch.cuda.synchronize()  # non-blocking gradient copies must land before the host reads them
            self.host_optimizer.step()
            self.host_steps += 1
            self._copy_params_to_device()
        self._share_state()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for host in self.host_copy.values():
            host.grad = None

    # ------------------------------------------------------------------ state under the original parameters
    def _share_state(self) -> None:
        """``self.state[p]`` is the very state dict of p's part (host state for offloaded parameters); for a
        sharded parameter the host state's shards are laid out as DTensors like the parameter (checkpoints
        save them sharded, as without offload), sharing the host storage."""
        self._original = {host: param for param, host in self.host_copy.items()}
        for param in (p for g in self.param_groups for p in g["params"]):
            part, inner = ((self.host_optimizer, self.host_copy[param]) if param in self.host_copy
                           else (self.device_optimizer, param))
            if inner not in part.state:
                continue
            entries = part.state[inner]
            if inner is not param and DTensor is not None and isinstance(param, DTensor):
                entries = {k: _as_shard_of(param, v) for k, v in entries.items()}
            self.state[param] = entries

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain optimizer's state dict: the groups' hyperparameters here, each parameter's state into its
        part (whose own loading puts it on that part's device: the host for offloaded parameters)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} param groups; this optimizer has "
                             f"{len(self.param_groups)}")
        index_of: dict[int, Any] = {}
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            index_of.update(zip(saved["params"], group["params"]))
        self.state.clear()
        self._sync_hyperparameters()
        for part, on_host in ((self.device_optimizer, False), (self.host_optimizer, True)):
            if part is None:
                continue
            position = {id(t): i for i, t in enumerate(t for g in part.param_groups for t in g["params"])}
            part_state = {}
            for index, entries in state_dict["state"].items():
                param = index_of[index]
                if (param in self.host_copy) == on_host:
                    inner = self.host_copy[param] if on_host else param
                    if on_host:  # sharded state arrives as DTensors: the host part keeps this rank's shards
                        entries = {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
                    part_state[position[id(inner)]] = entries
            own = part.state_dict()
            part.load_state_dict({"state": part_state, "param_groups": own["param_groups"]})
        self._share_state()


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A group's settings for a part: not its params, and not the kernel choice (each part picks its own for
    its device: fused on the host, whatever the device's tensors allow there)."""
    return {k: v for k, v in group.items() if k not in ("params", "fused", "foreach")}


def _as_shard_of(param: Any, value: Any) -> Any:
    """A host state tensor shaped like ``param``'s local shard, as a DTensor laid out like ``param``."""
    if not isinstance(value, torch.Tensor) or value.shape != _local(param).shape or not value.dim():
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def offload_optimizer(optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                      make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]) -> CpuOffloadOptimizer:
    """``optimizer``'s param groups split as ``optimizer_offload_fraction`` says, each part built by
    ``make_optimizer``; the pin and overlap switches from ``config``."""
    return CpuOffloadOptimizer(
        optimizer.param_groups, make_optimizer, float(config.optimizer_offload_fraction),
        pin_params=bool(config.pin_cpu_params),
        pin_grads=bool(config.pin_cpu_grads),
        overlap_copies=bool(config.overlap_cpu_optimizer_d2h_h2d),
    )
