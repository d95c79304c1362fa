"""logger.throughput_window_size: the rolling throughput (log_throughput_to_tensorboard) averages over that many
wall-clock marks, and the trainer keeps no more marks than the window needs."""

from __future__ import annotations

import pytest

from longspan.training.state import GlobalState
from longspan.training.utils import train_utils as tu
from tests.training.test_loggers import make_cfg, read_scalars


def _batches_per_sec(tmp_path, window: int) -> list[tuple[int, float]]:
    cfg = make_cfg(tmp_path / str(window), log_interval=1, log_throughput_to_tensorboard=True,
                   throughput_window_size=window, log_runtime_to_tensorboard=False)
    state = GlobalState(cfg)
    total, wct = {}, []
    for i in range(1, 7):
        state.train_state.step += 1
        state.train_state.consumed_train_samples += cfg.train.global_batch_size
        wct.append(float(i * i))  # iterations get slower: windows of different length see different rates
        tu.training_log({"lm loss": 1.0}, total, 2.5e-4, None, 4096.0, True, 0, 1.0, None, None, cfg, state, wct, [])
    state.close_loggers()
    return read_scalars(tmp_path / str(window) / "tb")["throughput/batches_per_sec"]


def test_window_sets_the_span_of_the_throughput_average(tmp_path) -> None:
    # window w: (w - 1) batches over the time from mark i - w + 1 to mark i (marks at i^2 seconds)
    assert _batches_per_sec(tmp_path, 3) == [(i, pytest.approx(2 / (i * i - (i - 2) ** 2))) for i in range(3, 7)]
    assert _batches_per_sec(tmp_path, 5) == [(i, pytest.approx(4 / (i * i - (i - 4) ** 2))) for i in range(5, 7)]


def test_bad_window_is_one_line() -> None:
    from longspan.config.rules.ranges import check_ranges
    from longspan.core.errors import ConfigError
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    cfg.logger.throughput_window_size = 0
    with pytest.raises(ConfigError, match="logger.throughput_window_size=0 is out of range"):
        check_ranges(cfg)
