"""straggler.straggler_ctrlr_port: a request to rank 0's port toggles the straggler detector on every rank at the
next logging step (Megatron's StragglerDetector controller)."""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import pytest

from longspan.config.schema.infra import StragglerDetectionConfig
from longspan.core.errors import ConfigError
from longspan.training.resilience.hooks import after_iteration, start_straggler_detection, stop_straggler_detection

LOG_INTERVAL = 2


def _state(rank: int = 0, disable_on_startup: bool = False) -> SimpleNamespace:
    straggler = StragglerDetectionConfig(log_straggler=True, straggler_ctrlr_port=0,
                                         disable_straggler_on_startup=disable_on_startup)
    cfg = SimpleNamespace(straggler=straggler, nvrx_straggler=None, logger=SimpleNamespace(log_interval=LOG_INTERVAL))
    return SimpleNamespace(cfg=cfg, parallel=SimpleNamespace(rank=rank), device="cpu",
                           train_state=SimpleNamespace(step=0), heartbeat=None)


def _request(state: SimpleNamespace) -> str:
    controller = state.straggler_controller
    with urllib.request.urlopen(f"http://{controller.host}:{controller.port}/", timeout=30) as reply:
        return reply.read().decode()


def _run_to(state: SimpleNamespace, step: int) -> None:
    while state.train_state.step < step:
        state.train_state.step += 1
        state.straggler_detector.iteration_started()
        after_iteration(state)


def test_a_request_toggles_detection_at_the_next_logging_step() -> None:
    state = _state(disable_on_startup=True)
    start_straggler_detection(state)
    detector = state.straggler_detector
    try:
        assert state.straggler_controller.port > 0 and not detector.enabled  # port 0: the OS chose one
        assert _request(state) == "Will turn StragglerDetector ON at next logging interval"
        _run_to(state, 1)
        assert not detector.enabled  # not a logging step
        _run_to(state, 2)
        assert detector.enabled
        _run_to(state, 3)
        assert detector.count == 1  # switched on: the steps are timed
        _request(state)
        _request(state)  # two requests before the logging step: one toggle
        _run_to(state, 4)
        assert not detector.enabled
        _run_to(state, 6)
        assert not detector.enabled and detector.count == 0
    finally:
        stop_straggler_detection(state)
    assert state.straggler_controller is None


def _toggle_on_two_ranks() -> list[bool]:
    import torch.distributed as dist

    from tests.parallel.harness import init_gloo

    init_gloo(timeout_s=60)
    state = _state(rank=dist.get_rank())
    start_straggler_detection(state)
    try:
        seen = [state.straggler_detector.enabled]
        if state.straggler_controller is not None:
            _request(state)
        _run_to(state, LOG_INTERVAL)
        seen.append(state.straggler_detector.enabled)
        return seen + [state.straggler_controller is not None]
    finally:
        stop_straggler_detection(state)


def test_rank_0_listens_and_every_rank_switches(pool2) -> None:
    assert pool2.run(_toggle_on_two_ranks, timeout=120) == [[True, False, True], [True, False, False]]


@pytest.mark.parametrize("port", [-1, 65536])
def test_port_outside_tcp_range_is_one_line(tmp_path, port: int) -> None:
    from tests.training.pretrain_helpers import small_config  # here: the pool's workers import this module

    cfg = small_config(tmp_path)
    cfg.straggler = StragglerDetectionConfig(straggler_ctrlr_port=port)
    with pytest.raises(ConfigError, match=f"straggler.straggler_ctrlr_port={port} is not a TCP port"):
        cfg.validate(world_size=1)


def test_a_busy_port_warns_once_and_detection_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    import socket

    from longspan.training.resilience.straggler_control import start_controller

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with caplog.at_level("WARNING"):
            assert start_controller(port, lambda: True) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"straggler.straggler_ctrlr_port={port}: the straggler detector cannot be" in warnings[0]
