"""Activation offload (``model.cpu_offloading``): what the first layers save for backward waits in host memory.

Megatron offloads through Transformer Engine's CPU-offload handler; here the same effect comes from torch's own
``torch.autograd.graph.saved_tensors_hooks`` (the mechanism of ``torch.autograd.graph.save_on_cpu``), applied
from outside to the forward of the first ``cpu_offloading_num_layers`` transformer layers of each model chunk:
every tensor such a layer saves for its backward is copied to the host when it is saved and copied back when the
backward needs it. ``cpu_offloading_activations`` and ``cpu_offloading_weights`` choose which saved tensors go:
the layer's inputs and intermediate results, and the layer's own parameters (as the forward used them: FSDP2's
all-gathered copies). On CUDA the host copies are pinned and the copies asynchronous; on a CPU the copies still
run (host to host), so the same code path is exercised everywhere. Saved tensors that are DTensors or other
tensor subclasses stay where they are. The maths is unchanged: backward reads bit-identical copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from longspan.core.logging import print_rank_0

if TYPE_CHECKING:
    from longspan.core.model_parallel_config import ModelParallelConfig


class SavedTensorOffload:
    """The pack/unpack pair that moves the tensors one layer saves for backward to the host and back."""

    def __init__(self, layer: nn.Module, activations: bool, weights: bool) -> None:
        self.layer, self.activations, self.weights = layer, activations, weights
        self.offloaded = 0  # tensors moved to the host so far (observable in tests and logs)
        self._param_storages: set[int] = set()

    def refresh_parameters(self) -> None:
        """Remember the storages of the layer's parameters as this forward sees them (FSDP2 swaps them)."""
        storages = set()
        for param in self.layer.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            storages.add(local.untyped_storage().data_ptr())
        self._param_storages = storages

    def pack(self, tensor: torch.Tensor) -> Any:
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            return tensor
        is_weight = tensor.untyped_storage().data_ptr() in self._param_storages
        if not (self.weights if is_weight else self.activations):
            return tensor
        pin = tensor.device.type == "cuda"
        host = torch.empty(tensor.size(), dtype=tensor.dtype, device="cpu", pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)
        self.offloaded += 1
        return tensor.device, host

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device, non_blocking=host.is_pinned())
        return packed


def _offloading_forward(forward: Callable[..., Any], offload: SavedTensorOffload) -> Callable[..., Any]:
    def forward_with_offload(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        offload.refresh_parameters()
        with torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack):
            return forward(*args, **kwargs)

    return forward_with_offload


def offloadable_layers(chunk: nn.Module) -> list[nn.Module]:
    """The chunk's transformer layers in order: every ``layers`` ModuleDict (T5: encoder's, then decoder's)."""
    layers: list[nn.Module] = []
    for name, module in chunk.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, nn.ModuleDict):
            layers.extend(module.values())
    return layers


def apply_activation_offload(chunks: list[nn.Module], model_config: ModelParallelConfig) -> list[SavedTensorOffload]:
    """Offload what the first ``model_config.cpu_offloading_num_layers`` layers of each chunk save for backward
    (nothing when ``cpu_offloading`` is off); returns one ``SavedTensorOffload`` per offloaded layer."""
    if not model_config.cpu_offloading:
        return []
    count = int(model_config.cpu_offloading_num_layers)
    activations = bool(model_config.cpu_offloading_activations)
    weights = bool(model_config.cpu_offloading_weights)
    handlers = []
    for chunk in chunks:
        for layer in offloadable_layers(chunk)[:count]:
            offload = SavedTensorOffload(layer, activations, weights)
            layer.forward = _offloading_forward(layer.forward, offload)  # instance attribute: wraps compile too
            handlers.append(offload)
    what = " and ".join(n for n, on in (("activations", activations), ("weights", weights)) if on)
    print_rank_0(f"model.cpu_offloading: {what} saved by {len(handlers)} layer(s) wait in host memory")
    return handlers
