"""The ``comm_overlap`` section (Megatron Bridge's ``CommOverlapConfig``): communication-overlap settings derived
from the parallel layout, then the user's values on top, copied onto the model, ddp and optimizer fields.

As Bridge's ``CommOverlapConfig``: tensor-parallel overlap (``model.tp_comm_overlap``, torch's asynchronous TP
here) is switched off with a warning when tensor parallel is below 2 or sequence parallel is off; pipeline
parallel gets ``overlap_p2p_comm`` with virtual stages and ``batch_p2p_comm`` without; data parallel above 1
gets 128 MiB buckets and overlapped gradient reduction and parameter gather. Two differences, where Bridge's
derived value would name a field longspan lacks or a gather that does not exist: ``overlap_param_gather`` is
derived only with sharded parameters (distributed optimizer or FSDP2), and ``align_param_gather``,
``overlap_param_gather_with_optimizer_step``, ``defer_embedding_wgrad_compute`` and ``wgrad_deferral_limit``
travel only when the user sets them. Every field this changes is named in one start-up line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from longspan.core.errors import ConfigError
from longspan.core.logging import get_logger, print_rank_0, warn_rank_0

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer

_log = get_logger(__name__)

# comm_overlap key -> the section whose field of the same name it sets
COMM_OVERLAP_TARGETS: dict[str, str] = {
    "tp_comm_overlap": "model", "tp_comm_overlap_cfg": "model", "tp_comm_bootstrap_backend": "model",
    "overlap_p2p_comm": "model", "batch_p2p_comm": "model",
    "defer_embedding_wgrad_compute": "model", "wgrad_deferral_limit": "model",
    "overlap_grad_reduce": "ddp", "overlap_param_gather": "ddp", "align_param_gather": "ddp", "bucket_size": "ddp",
    "overlap_param_gather_with_optimizer_step": "optimizer",
}
_OTHER_KEYS = ("_target_", "data_parallel_size")


def _user_values(section: Any) -> dict[str, Any]:
    if not isinstance(section, dict):
        raise ConfigError(f"comm_overlap={section!r} must be a mapping of CommOverlapConfig fields")
    unknown = sorted(str(k) for k in section if k not in COMM_OVERLAP_TARGETS and k not in _OTHER_KEYS)
    if unknown:
        raise ConfigError(f"comm_overlap has unknown key(s) {', '.join(unknown)}: valid keys are "
                          f"{', '.join(list(COMM_OVERLAP_TARGETS) + ['data_parallel_size'])}")
    return {k: v for k, v in section.items() if k in COMM_OVERLAP_TARGETS and v is not None}


def derived_comm_overlap(cfg: "ConfigContainer", data_parallel_size: int) -> dict[str, Any]:
    """The settings ``cfg.comm_overlap`` stands for on ``data_parallel_size`` data-parallel ranks."""
    user = _user_values(cfg.comm_overlap)
    given_dp = cfg.comm_overlap.get("data_parallel_size")
    if given_dp is not None and given_dp != data_parallel_size:
        raise ConfigError(f"comm_overlap.data_parallel_size={given_dp!r} differs from the layout's data-parallel "
                          f"size {data_parallel_size}: leave it null")
    m = cfg.model
    if user.get("tp_comm_overlap") and (m.tensor_model_parallel_size < 2 or not m.sequence_parallel):
        warn_rank_0(f"comm_overlap.tp_comm_overlap=True is switched off: it needs tensor_model_parallel_size >= 2 "
                    f"(here {m.tensor_model_parallel_size}) and sequence_parallel (here {m.sequence_parallel})", _log)
        user["tp_comm_overlap"] = False
    pp, vp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    sharded = bool(cfg.optimizer.use_distributed_optimizer or cfg.dist.use_torch_fsdp2)
    derived: dict[str, Any] = {
        "tp_comm_overlap": False,
        "overlap_p2p_comm": pp > 1 and vp > 1,
        "batch_p2p_comm": pp > 1 and vp == 1,
        "bucket_size": 128 * 1024 * 1024 if data_parallel_size > 1 else None,
        "overlap_grad_reduce": data_parallel_size > 1,
        "overlap_param_gather": data_parallel_size > 1 and sharded,
    }
    return {**derived, **user}


def apply_comm_overlap(cfg: "ConfigContainer", data_parallel_size: int) -> None:
    """Copy the comm_overlap settings onto their fields (nothing when the section is unset) and name every
    field whose value changes."""
    if cfg.comm_overlap is None:
        return
    changed = []
    for key, value in derived_comm_overlap(cfg, data_parallel_size).items():
        section = getattr(cfg, COMM_OVERLAP_TARGETS[key])
        before = getattr(section, key)
        if before != value:
            setattr(section, key, value)
            changed.append(f"{COMM_OVERLAP_TARGETS[key]}.{key}={value!r} (was {before!r})")
    if changed:
        print_rank_0(f"comm_overlap sets {', '.join(changed)}", _log)
