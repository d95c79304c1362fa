"""Asynchronous tensor parallel (``model.tp_comm_overlap``): torch's answer to Transformer Engine's userbuffer
overlap of the tensor-parallel all-gather / reduce-scatter with the linear layers' GEMMs.

Inductor's micro-pipelined TP pass (``torch._inductor.config._micro_pipeline_tp``) rewrites the sequence-parallel
all-gather -> matmul and matmul -> reduce-scatter pairs of a compiled layer into fused ops that chunk the GEMM
and move each chunk through symmetric memory while the next one computes (torchtitan's async TP). It needs CUDA,
tensor parallel with sequence parallel (validate() checks both flags) and the per-layer compile
(``longspan.parallel.compile``): on another device, or where compile is unavailable, the layers run with their
plain collectives and start-up says so. The maths is unchanged: the fused ops compute the same products.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from longspan.core.logging import get_logger, warn_rank_0

if TYPE_CHECKING:
    from longspan.core.model_parallel_config import ModelParallelConfig

_log = get_logger(__name__)


def enable_async_tensor_parallel(model_config: ModelParallelConfig, tp_group: Any, device: torch.device, compiled: bool) -> bool:
    """Turn on inductor's micro-pipelined TP for ``tp_group`` when ``model_config.tp_comm_overlap`` asks and this
    run can use it (CUDA, a tensor-parallel group, compiled layers); returns whether it did. Call after
    ``compile_model`` and before the first forward (inductor compiles lazily, at the first call)."""
    if not model_config.tp_comm_overlap or tp_group is None or device.type != "cuda":
        return False  # CPU runs: listed once at start-up as not applicable (longspan.config.support)
    if not compiled:
        warn_rank_0("model.tp_comm_overlap: the layers are not compiled here (see the train.torch_compile line), "
                    "so tensor-parallel communication is not overlapped", _log)
        return False
    _inductor_config()._micro_pipeline_tp = True
    _enable_symmetric_memory(tp_group.group_name)
    return True


def _inductor_config() -> Any:
    # start-up time: inductor loads only when asynchronous TP is on
    import torch._inductor.config as inductor_config

    return inductor_config


def _enable_symmetric_memory(group_name: str) -> None:
    # start-up time: symmetric memory loads only when asynchronous TP is on
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(group_name)
