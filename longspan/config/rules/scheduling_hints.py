"""Rules of ``ConfigContainer.validate()`` for Megatron's compute-scheduling and memory-layout switches that change
no maths here (performance hints in ``longspan.config.support``): megatron-core's own consistency rules still hold,
so a config that Megatron rejects is rejected here too, and a value that only another switch reads is not set alone.

- ``distribute_saved_activations``: Megatron splits full recompute's saved inputs over the tensor-parallel ranks (a
  memory layout; torch's checkpoint keeps them whole). Not with sequence parallel (megatron-core).
- ``defer_embedding_wgrad_compute`` / ``wgrad_deferral_limit``: Megatron computes the output layer's weight
  gradients at the pipeline flush (the same sums, later). Needs pipeline parallel and gradient_accumulation_fusion;
  the limit is >= 0 and read only with the deferral (megatron-core).
- ``delay_wgrad_compute``: Megatron computes weight gradients after the MoE all-to-all they overlap (the same
  gradients). Needs overlap_moe_expert_parallel_comm (megatron-core).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from longspan.core.errors import ConfigError

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer


def check_scheduling_hints(cfg: "ConfigContainer") -> None:
    """Every rule of this module, in order."""
    m = cfg.model
    if m.distribute_saved_activations and m.sequence_parallel:
        raise ConfigError("model.distribute_saved_activations=True must be False with model.sequence_parallel=True "
                          "(megatron-core's rule: sequence parallel already splits the saved activations)")
    _check_embedding_wgrad_deferral(m)
    if m.delay_wgrad_compute and not m.overlap_moe_expert_parallel_comm:
        raise ConfigError("model.delay_wgrad_compute=True needs model.overlap_moe_expert_parallel_comm=True (the "
                          "all-to-all the delayed weight gradients overlap; megatron-core's rule)")


def _check_embedding_wgrad_deferral(m: object) -> None:
    limit = m.wgrad_deferral_limit
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ConfigError(f"model.wgrad_deferral_limit={limit!r} must be an integer >= 0 (0 defers every microbatch)")
    if not m.defer_embedding_wgrad_compute:
        if limit:
            raise ConfigError(f"model.wgrad_deferral_limit={limit} is read only with "
                              "model.defer_embedding_wgrad_compute=True: set that or leave the limit at 0")
        return
    if m.pipeline_model_parallel_size == 1:
        raise ConfigError("model.defer_embedding_wgrad_compute=True needs model.pipeline_model_parallel_size > 1 "
                          "(the weight gradients wait for the pipeline flush; megatron-core's rule)")
    if not m.gradient_accumulation_fusion:
        raise ConfigError("model.defer_embedding_wgrad_compute=True needs model.gradient_accumulation_fusion=True "
                          "(megatron-core's rule)")
