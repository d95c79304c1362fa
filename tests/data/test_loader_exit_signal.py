"""train.exit_signal_handler_for_dataloader: data workers catch the exit signal instead of dying on it."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from longspan.core.errors import ConfigError
from longspan.data.loaders import build_pretraining_data_loader
from tests.training.pretrain_helpers import small_config


class _HandlerProbe:
    """Each sample says whether the process that loads it has its own handler for SIGUSR1."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> bool:
        return signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, signal.SIG_IGN, None)

    @staticmethod
    def collate_fn(samples: list[bool]) -> list[bool]:
        return samples


@pytest.mark.timeout(120)
def test_workers_catch_the_exit_signal_only_when_asked() -> None:
    def handled_in_worker(sig):
        loader = build_pretraining_data_loader(_HandlerProbe(), 0, "single", 2, num_workers=1, data_sharding=True,
                                               worker_exit_signal=sig)
        return next(iter(loader))

    previous = signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # a known start: workers inherit it under fork
    try:
        assert handled_in_worker(signal.SIGUSR1) == [True, True]
        assert handled_in_worker(None) == [False, False]
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the main process is left alone
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_it_needs_the_exit_signal_handler(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    cfg.train.exit_signal_handler_for_dataloader = True
    with pytest.raises(ConfigError, match="exit_signal_handler_for_dataloader=True needs train.exit_signal_handler"):
        cfg.validate(world_size=1)
    cfg.train.exit_signal_handler = True
    cfg.validate(world_size=1)
