"""Small helpers the training and validation logs share: process-group lookups and the scalar sinks."""

from __future__ import annotations

from typing import Any

from longspan.training.state import GlobalState


def option(section: Any, name: str, default: Any = None) -> Any:
    """``section.name`` (``default`` when the section is None or lacks it): for a caller's process-group
    collection (megatron-core's ``ProcessGroupCollection`` holds only the groups it was given), not for configs."""
    return default if section is None else getattr(section, name, default)


def logger_sinks(global_state: GlobalState) -> dict[str, Any]:
    """The scalar sinks as ``log_scalars`` keyword arguments (None where a sink is off or not this rank's)."""
    return {
        "tb_writer": global_state.tensorboard_logger,
        "wandb_logger": global_state.wandb_logger,
        "mlflow_logger": global_state.mlflow_logger,
        "comet_logger": global_state.comet_logger,
    }


def write_vs_samples(tb_writer: Any, metrics: dict[str, Any], consumed_samples: int) -> None:
    """Megatron also writes each scalar against consumed samples as ``'<tag> vs samples'``."""
    if tb_writer is None:
        return
    for tag, value in metrics.items():
        tb_writer.add_scalar(f"{tag} vs samples", value, consumed_samples)
