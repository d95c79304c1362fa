"""QLoRA: the frozen base weights of the adapted linear layers stored in NF4 (``longspan.peft.nf4``).

``peft.base_quantization='nf4'`` turns every adapted ``LoRALinear`` into an ``NF4LoRALinear`` once the base
weights are loaded (``quantize_base_weights``): its ``weight`` parameter is replaced by non-persistent NF4
buffers (packed 4-bit codes, float32 block scales) and its forward dequantizes the weight in the compute dtype,
layer by layer, in forward and again in backward (``NF4LinearFunction``). The adapters, biases, norms,
embedding and output layer keep their precision; routed-expert weights are not quantized.

The quantized base is never saved: a resumed run loads the base from ``checkpoint.pretrained_checkpoint`` and
quantizes it again, which is deterministic, so the adapter checkpoint stays small and resuming is exact.

Layouts. The quantization runs on what each rank holds after the parallel plans:

- tensor parallel: the rank's shard of the weight (``Shard(0)`` for column-parallel, ``Shard(1)`` for
  row-parallel). NF4 blocks run along a row's input columns and never cross rows, so a row shard has exactly
  the whole weight's blocks, and a column shard does when its width is a multiple of the block size (64);
  then TP computes with the very numbers one process does. The forward runs on the local shard and hands back
  the DTensor ColwiseParallel / RowwiseParallel would have produced (``Shard(-1)`` / ``Partial``);
- FSDP2 / the distributed optimizer: the base weights of quantized layers are kept out of ``fully_shard``
  (``parallel.parallelize`` hides them, as it hides expert weights) so every data-parallel rank holds the whole
  (TP-local) weight in NF4, 0.5625 byte per parameter, instead of a bf16 shard; the adapters are sharded as
  usual. Frozen weights have no gradients or optimizer state, so there is nothing else to shard;
- DDP, pipeline and context parallel need nothing: each rank quantizes the layers it holds.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from longspan.core.errors import NotSupportedError
from longspan.core.logging import get_logger, print_rank_0
from longspan.peft.config import LowRankAdapterConfig
from longspan.peft.modules import LoRALinear
from longspan.peft.nf4 import DEFAULT_BLOCK_SIZE, dequantize_nf4, nf4_linear, quantize_nf4

logger = get_logger(__name__)

BASE_QUANTIZATIONS = ("nf4",)
#: the attribute ``apply_adapters`` sets on each adapted layer whose base will be quantized
QUANTIZE_MARK = "base_quantization"


class NF4LoRALinear(LoRALinear):
    """A ``LoRALinear`` whose frozen base weight is stored in NF4 (buffers ``nf4_packed``, ``nf4_absmax``).

    ``weight`` reads as the dequantized weight (a DTensor under tensor parallel) for merging and export; the
    forward never materializes it beyond one layer's matmul."""

    nf4_columns: int
    nf4_dtype: torch.dtype
    nf4_tensor_parallel: Optional[tuple[Any, str]]

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        local = dequantize_nf4(self.nf4_packed, self.nf4_absmax, self.nf4_columns, self.nf4_dtype)
        if self.nf4_tensor_parallel is None:
            return local
        mesh, kind = self.nf4_tensor_parallel
        return DTensor.from_local(local, mesh, [Shard(0 if kind == "column" else 1)], run_check=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_output(x) + self.adapter(x)

    def base_output(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ + b`` from the NF4 weight (the layout ``F.linear`` with the TP weight would give)."""
        if self.nf4_tensor_parallel is None:
            out = nf4_linear(x, self.nf4_packed, self.nf4_absmax, self.nf4_columns)
            return out if self.bias is None else out + self.bias
        mesh, kind = self.nf4_tensor_parallel
        if kind == "column":  # x replicated; each rank computes its output columns; x's gradient sums over ranks
            local = nf4_linear(x.to_local(grad_placements=[Partial()]), self.nf4_packed, self.nf4_absmax,
                               self.nf4_columns)
            if self.bias is not None:
                local = local + self.bias.to_local()
            return DTensor.from_local(local, mesh, [Shard(local.dim() - 1)], run_check=False)
        # row-parallel: x split over its last dimension; the products are partial sums
        local = nf4_linear(x.to_local(), self.nf4_packed, self.nf4_absmax, self.nf4_columns)
        out = DTensor.from_local(local, mesh, [Partial()], run_check=False)
        return out if self.bias is None else out.redistribute(mesh, [Replicate()]) + self.bias


def _tensor_parallel_kind(weight: torch.Tensor, name: str) -> Optional[tuple[Any, str]]:
    if not isinstance(weight, DTensor):
        return None
    placements = tuple(weight.placements)
    if weight.device_mesh.ndim == 1 and placements in ((Shard(0),), (Shard(1),)):
        return weight.device_mesh, "column" if placements[0] == Shard(0) else "row"
    raise NotSupportedError(
        f"peft.base_quantization: {name}.weight is laid out as {placements} on a {weight.device_mesh.ndim}-D mesh; "
        "NF4 handles whole weights and 1-D tensor-parallel shards (Shard(0) / Shard(1)) only"
    )


@torch.no_grad()
def quantize_layer(layer: LoRALinear, name: str = "layer", block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """Store ``layer``'s base weight (this rank's part of it) in NF4 and make it an ``NF4LoRALinear``."""
    weight = layer.weight
    tensor_parallel = _tensor_parallel_kind(weight, name)
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    if tensor_parallel is not None and tensor_parallel[1] == "row" and local.shape[1] % block_size:
        logger.warning(
            "peft.base_quantization: %s is split over its %d input columns into shards of %d, not a multiple of the "
            "NF4 block size %d: the blocks at shard edges differ from one process's (the run is not bit-comparable "
            "with a one-process run)", name, weight.shape[1], local.shape[1], block_size)
    packed, absmax = quantize_nf4(local, block_size)
    layer.__class__ = NF4LoRALinear
    del layer._parameters["weight"]
    layer.register_buffer("nf4_packed", packed, persistent=False)
    layer.register_buffer("nf4_absmax", absmax, persistent=False)
    layer.nf4_columns, layer.nf4_dtype, layer.nf4_tensor_parallel = local.shape[1], weight.dtype, tensor_parallel
    if not isinstance(weight, DTensor):
        # whatever else still holds the parameter (a DDP wrapper's list) keeps an empty tensor, not the weight
        weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)


def quantize_base_weights(model_chunks: list[torch.nn.Module] | torch.nn.Module,
                          peft: Optional[LowRankAdapterConfig]) -> int:
    """Quantize the base weight of every adapted linear layer marked by ``apply_adapters`` (after the base
    weights are loaded); returns how many layers were quantized (0 without ``peft.base_quantization``)."""
    if peft is None or peft.base_quantization is None:
        return 0
    chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
    count, params = 0, 0
    for chunk in chunks:
        for name, module in list(chunk.named_modules()):
            if type(module) is LoRALinear and getattr(module, QUANTIZE_MARK, None) == "nf4":
                params += module.weight.numel()
                quantize_layer(module, name)
                count += 1
    print_rank_0(f"peft: base weights of {count} adapted linear layers ({params:,} parameters on this rank) "
                 "stored in NF4 (4-bit, block 64, float32 scales)", logger)
    return count

