"""The few calls the training loop makes into the resilience objects (kept here so train.py stays short)."""

from __future__ import annotations

from typing import Any

from longspan.training.resilience.events import report_event
from longspan.training.resilience.rerun import RerunStateMachine


def ensure_rerun_state_machine(state: Any) -> RerunStateMachine:
    """The run's rerun state machine (setup builds it before loading a checkpoint; built here otherwise)."""
    if state.rerun_state_machine is None:
        state.rerun_state_machine = build_rerun_state_machine(state.cfg)
    return state.rerun_state_machine


def build_rerun_state_machine(cfg: Any) -> RerunStateMachine:
    return RerunStateMachine(cfg.rerun_state_machine, report_interval=cfg.logger.log_interval or 1)


def after_forward_backward(state: Any, iteration: int) -> tuple[bool, bool, int]:
    """Report the rerun machine's events and statistics; (save a checkpoint, exit, exit code)."""
    machine = state.rerun_state_machine
    for event in machine.take_events():
        extra = {k: v for k, v in event.items() if k not in ("kind", "message")}
        report_event(state, "rerun", f"{event['kind']}: {event['message']}", all_ranks=True, **extra)
    if machine.mode == "report_stats" and iteration % machine.report_interval == 0:
        stats = machine.take_stats()  # collective
        if stats is not None:
            report_event(
                state, "rerun_stats",
                f"result variability over {stats['reruns']} re-runs: max relative difference "
                f"{stats['max_relative_diff']:.3e}, mean {stats['mean_relative_diff']:.3e}, "
                f"{stats['nonzero_diffs']} differed", **stats,
            )
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()
    if should_exit:
        report_event(state, "rerun", f"exiting with code {exit_code}" + (" after saving a checkpoint" if
                     should_checkpoint else ""), exit_code=exit_code)
    return should_checkpoint, should_exit, exit_code
