"""Config rules of the resilience fields, called by ``ConfigContainer.validate()`` (imports only ``core``)."""

from __future__ import annotations

from typing import Any

from longspan.core.errors import ConfigError, NotSupportedError


def check_resilience_config(cfg: Any) -> None:
    """Reject resilience settings longspan cannot honour, naming the field and what would be valid."""
    _check_non_persistent(cfg.checkpoint)
    _check_rerun(cfg.rerun_state_machine, cfg.checkpoint)
    if cfg.ft is not None:
        _check_ft(cfg.ft)
    if cfg.inprocess_restart is not None:
        _check_inprocess(cfg.inprocess_restart, cfg.ft)
    if cfg.straggler is not None:
        _check_straggler_port(cfg.straggler.straggler_ctrlr_port)


def _check_straggler_port(port: Any) -> None:
    """A TCP port, or 0 for one the OS chooses (rank 0's toggle listener, straggler_control)."""
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise ConfigError(f"straggler.straggler_ctrlr_port={port!r} is not a TCP port: use 1-65535, or 0 for a free "
                          "port the OS chooses")


_INPROCESS_SECONDS = ("monitor_thread_interval", "monitor_process_interval", "progress_watchdog_interval",
                      "heartbeat_interval", "soft_timeout", "hard_timeout", "heartbeat_timeout", "barrier_timeout",
                      "completion_timeout")


def _check_inprocess(ipr: Any, ft: Any) -> None:
    for name in _INPROCESS_SECONDS:
        value = getattr(ipr, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"inprocess_restart.{name}={value!r} is not valid: use a positive number of seconds")
    for name in ("last_call_wait", "termination_grace_time"):
        value = getattr(ipr, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"inprocess_restart.{name}={value!r} is not valid: use seconds >= 0")
    for name in ("max_iterations", "max_rank_faults"):
        value = getattr(ipr, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(
                f"inprocess_restart.{name}={value!r} is not valid: use None (no limit) or an integer >= 0")
    active = ipr.active_world_size
    if active is not None and (isinstance(active, bool) or not isinstance(active, int) or active < 1):
        raise ConfigError(f"inprocess_restart.active_world_size={active!r} is not valid: use None (every process "
                          "runs the workload) or a number of ranks >= 1")
    if not ipr.soft_timeout < ipr.hard_timeout:
        raise ConfigError(
            f"inprocess_restart.soft_timeout={ipr.soft_timeout!r} is not valid: use fewer seconds than "
            f"inprocess_restart.hard_timeout={ipr.hard_timeout!r} (a stalled rank is interrupted before it is ended)")
    if ipr.granularity not in ("node", "rank"):
        raise ConfigError(f"inprocess_restart.granularity={ipr.granularity!r} is not valid: use 'node' or 'rank'")
    if ipr.enabled and ft is not None and ft.enable_ft_package:
        raise NotSupportedError(
            "inprocess_restart.enabled=True with ft.enable_ft_package=True is not supported yet: choose one (the "
            "in-process supervisor watches heartbeats and progress itself)"
        )


def _check_ft(ft: Any) -> None:
    kinds = ("rank_hung", "rank_killed", "random")
    if ft.simulated_fault_type not in kinds:
        raise ConfigError(f"ft.simulated_fault_type={ft.simulated_fault_type!r} is not valid: use one of {', '.join(kinds)}")
    if ft.simulated_fault_rank is not None and ft.simulated_fault_rank < 0:
        raise ConfigError(f"ft.simulated_fault_rank={ft.simulated_fault_rank} is not valid: use None or a rank >= 0")
    if ft.simulated_fault_base_delay < 0:
        raise ConfigError(f"ft.simulated_fault_base_delay={ft.simulated_fault_base_delay} is not valid: use seconds >= 0")
    if (ft.simulate_fault or ft.calc_ft_timeouts) and not ft.enable_ft_package:
        field = "simulate_fault" if ft.simulate_fault else "calc_ft_timeouts"
        raise ConfigError(f"ft.{field}=True needs ft.enable_ft_package=True")


def _check_rerun(r: Any, c: Any) -> None:
    modes = ("disabled", "validate_results", "report_stats")
    if r.rerun_mode not in modes:
        raise ConfigError(f"rerun_state_machine.rerun_mode={r.rerun_mode!r} is not valid: use one of {', '.join(modes)}")
    kinds = ("correct_result", "transient_error", "persistent_error")
    if r.error_injection_type not in kinds:
        raise ConfigError(
            f"rerun_state_machine.error_injection_type={r.error_injection_type!r} is not valid: use one of "
            f"{', '.join(kinds)}"
        )
    if r.error_injection_rate and r.rerun_mode != "validate_results":
        raise ConfigError(
            f"rerun_state_machine.error_injection_rate={r.error_injection_rate} needs "
            f"rerun_state_machine.rerun_mode='validate_results' (it is {r.rerun_mode!r}): injected errors are only "
            "diagnosed there"
        )
    if not r.spiky_loss_factor > 1.0:
        raise ConfigError(f"rerun_state_machine.spiky_loss_factor={r.spiky_loss_factor} is not valid: use a number > 1")
    if r.rerun_mode == "validate_results" and not c.save:
        raise ConfigError(
            "rerun_state_machine.rerun_mode='validate_results' needs checkpoint.save: a rejected iteration is saved "
            "before exiting with code 16 or 17"
        )


def _check_non_persistent(c: Any) -> None:
    kind = c.non_persistent_ckpt_type
    if kind == "in_memory":
        raise NotSupportedError(
            "checkpoint.non_persistent_ckpt_type='in_memory' is not supported yet by longspan (supported: 'global', "
            "'local')"
        )
    if kind is not None and kind not in ("global", "local"):
        raise ConfigError(f"checkpoint.non_persistent_ckpt_type={kind!r} is not valid: use None, 'global' or 'local'")
    if c.non_persistent_save_interval is not None and kind is None:
        raise ConfigError(
            f"checkpoint.non_persistent_save_interval={c.non_persistent_save_interval} needs "
            "checkpoint.non_persistent_ckpt_type ('global' or 'local')"
        )
    if kind is not None and not c.non_persistent_save_interval:
        raise ConfigError(
            f"checkpoint.non_persistent_ckpt_type={kind!r} needs checkpoint.non_persistent_save_interval (iterations)"
        )
    if kind == "local" and not c.non_persistent_local_ckpt_dir:
        raise ConfigError(
            "checkpoint.non_persistent_ckpt_type='local' needs checkpoint.non_persistent_local_ckpt_dir "
            "(node-local storage each rank writes its own files to)"
        )
    if kind == "global" and not (c.non_persistent_global_ckpt_dir or c.save):
        raise ConfigError(
            "checkpoint.non_persistent_ckpt_type='global' needs checkpoint.non_persistent_global_ckpt_dir "
            "(or checkpoint.save, whose non_persistent/ subdirectory is then used)"
        )
    if c.replication and kind != "local":
        raise ConfigError(
            f"checkpoint.replication=True replicates local checkpoints: it needs checkpoint.non_persistent_ckpt_type="
            f"'local' (got {kind!r})"
        )
    if c.non_persistent_local_ckpt_algo not in ("fully_parallel", "atomic"):
        raise ConfigError(
            f"checkpoint.non_persistent_local_ckpt_algo={c.non_persistent_local_ckpt_algo!r} is not valid: "
            "use 'fully_parallel' or 'atomic'"
        )
