"""The few calls the training loop makes into the resilience objects (kept here so train.py stays short)."""

from __future__ import annotations

from typing import Any

from longspan.core.logging import get_logger
from longspan.training.resilience.events import report_event
from longspan.training.resilience.rerun import RerunStateMachine
from longspan.training.resilience.heartbeat import HEARTBEAT_DIR_ENV, RankHeartbeat
from longspan.training.resilience.inprocess import end_progress_watch, report_progress, start_progress_watch
from longspan.training.resilience.straggler import StragglerDetector, straggler_settings
from longspan.training.resilience.straggler_control import agree_on_toggle, start_controller

logger = get_logger(__name__)


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


# ----------------------------------------------------------------------------------- fault tolerance (ft)


def start_fault_tolerance(state: Any) -> None:
    """Setup: this rank's heartbeat (``ft.enable_ft_package``) and the simulated fault (``ft.simulate_fault``)."""
    cfg = state.cfg
    parallel = state.parallel
    beat = RankHeartbeat(cfg.ft, cfg.checkpoint.save, parallel.rank, parallel.world_size)
    state.heartbeat = beat
    if cfg.ft is not None and cfg.ft.enable_ft_package and not beat.enabled and parallel.rank == 0:
        report_event(state, "fault_tolerance", f"ft.enable_ft_package is on but no launcher watches this run "
                     f"({HEARTBEAT_DIR_ENV} is unset): start it with longspan pretrain --nproc-per-node N")
    beat.beat("setup")
    beat.start_simulated_fault(cfg.rng.seed)


def _heartbeat(state: Any) -> Any:
    return getattr(state, "heartbeat", None)


def training_loop_started(state: Any) -> None:  # noqa: ARG001 - the loop's hook signature
    """The training loop starts: in-process restart's soft_timeout counts from here (and from each progress)."""
    start_progress_watch()


def training_loop_finished(state: Any) -> None:  # noqa: ARG001 - the loop's hook signature
    """The training loop ended (the test evaluation and the shutdown are not watched for progress)."""
    end_progress_watch()


def after_iteration(state: Any) -> None:
    """After every training iteration: the heartbeat, in-process restart's progress, the straggler detector
    (collective when it reports)."""
    report_progress()
    beat = _heartbeat(state)
    if beat is not None:
        beat.iteration_done(state.train_state.step)
    _straggler_report(state)


def checkpoint_phase_started(state: Any) -> None:
    report_progress()
    beat = _heartbeat(state)
    if beat is not None:
        beat.checkpoint_started()


def checkpoint_phase_finished(state: Any) -> None:
    report_progress()
    beat = _heartbeat(state)
    if beat is not None:
        beat.checkpoint_finished()


# --------------------------------------------------------------------------------------------- straggler


def start_straggler_detection(state: Any) -> None:
    """Setup: the straggler detector when ``straggler.log_straggler`` or ``nvrx_straggler.enabled`` is on, and
    rank 0's listener on ``straggler.straggler_ctrlr_port``."""
    settings = straggler_settings(state.cfg)
    detector = None if settings is None else StragglerDetector(
        settings, check_every=state.cfg.logger.log_interval or 1, device=state.device)
    state.straggler_detector = detector
    state.straggler_controller = None
    if detector is not None and settings.control_port is not None and state.parallel.rank == 0:
        state.straggler_controller = start_controller(settings.control_port, lambda: detector.enabled)
    state.resilience_stop = False


def stop_straggler_detection(state: Any) -> None:
    """End of the run: close rank 0's listener (the port is free again)."""
    controller = getattr(state, "straggler_controller", None)
    if controller is not None:
        controller.close()
        state.straggler_controller = None


def before_iteration(state: Any) -> None:
    """Before every training iteration: start the straggler detector's step timer."""
    detector = getattr(state, "straggler_detector", None)
    if detector is not None:
        detector.iteration_started()


def _straggler_report(state: Any) -> None:
    detector = getattr(state, "straggler_detector", None)
    if detector is None:
        return
    detector.iteration_done()
    report = detector.maybe_report(state.train_state.step)
    _apply_straggler_toggle(state, detector)
    if report is None:
        return
    if state.parallel.rank == 0:
        for line in detector.format(report):
            logger.info(line)
    if report.stragglers:
        stop = detector.settings.stop_if_detected
        report_event(state, "straggler", f"ranks {report.stragglers} straggle at iteration {report.iteration} "
                     f"(mean step times {[round(t * 1e3, 2) for t in report.mean_step_s]} ms)"
                     + ("; stopping (nvrx_straggler.stop_if_detected) after a checkpoint" if stop else ""),
                     stragglers=report.stragglers, mean_step_s=report.mean_step_s, relative=report.relative,
                     individual=report.individual)
        state.resilience_stop = state.resilience_stop or stop


def _apply_straggler_toggle(state: Any, detector: StragglerDetector) -> None:
    """At each logging step (Megatron's report interval) every rank takes rank 0's pending toggle request."""
    settings = detector.settings
    if settings.control_port is None or state.train_state.step % (settings.report_every_iterations or 1):
        return
    controller = getattr(state, "straggler_controller", None)
    if agree_on_toggle(controller is not None and controller.take_toggle_request(), detector.device):
        detector.set_enabled(not detector.enabled)
        if state.parallel.rank == 0:
            logger.info(f"Toggling StragglerDetector State {'ON' if detector.enabled else 'OFF'}")


def resilience_stop_requested(state: Any) -> bool:
    """True when a resilience feature ends the run cleanly (straggler stop_if_detected); the final save follows."""
    return bool(getattr(state, "resilience_stop", False))
