"""logger.log_energy: the RAPL reader, the interval numbers, and the run with and without counters."""

from __future__ import annotations

from pathlib import Path

import pytest

import longspan.training.observability.energy as energy
from tests.parallel.harness import get_shared_pool, init_gloo
from longspan.config.support import DEVICE, field_status
from longspan.training.pretrain import pretrain
from longspan.training.step.forward_step import forward_step
from longspan.training.observability.energy import EnergyMonitor, RaplCounter, interval_energy
from tests.training.pretrain_helpers import read_metrics, small_config


def _zone(root: Path, name: str, energy_uj: int, max_range_uj: int) -> Path:
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_range_uj}\n")
    return zone


def _set(zone: Path, energy_uj: int) -> None:
    (zone / "energy_uj").write_text(f"{energy_uj}\n")


def test_rapl_sums_packages_ignores_subzones_and_unwraps(tmp_path: Path) -> None:
    pkg0 = _zone(tmp_path, "intel-rapl:0", 5_000_000, 10_000_000)
    pkg1 = _zone(tmp_path, "intel-rapl:1", 100, 262_143_328_850)
    sub = _zone(tmp_path, "intel-rapl:0:0", 7, 10_000_000)  # a core sub-zone: counted within its package
    (tmp_path / "intel-rapl").mkdir()  # the control-type directory
    counter = RaplCounter.find(tmp_path)
    assert counter is not None and [z.name for z in counter.zones] == ["intel-rapl:0", "intel-rapl:1"]
    assert counter.joules() == 0.0
    _set(pkg0, 9_000_000)
    _set(pkg1, 2_000_100)
    _set(sub, 9_999_999)
    assert counter.joules() == pytest.approx(4.0 + 2.0)
    # pkg0 wraps: 9.0 J -> 10.0 J (range end) -> 0 -> 1.5 J is 2.5 J (+1 µJ for the step through zero)
    _set(pkg0, 1_500_000)
    assert counter.joules() == pytest.approx(6.0 + 2.5 + 1e-6)


def test_rapl_absent_or_unreadable_is_none(tmp_path: Path) -> None:
    assert RaplCounter.find(tmp_path / "missing") is None
    assert RaplCounter.find(tmp_path) is None  # no zones
    zone = _zone(tmp_path, "intel-rapl:0", 1, 10)
    (zone / "energy_uj").write_text("permission denied")
    assert RaplCounter.find(tmp_path) is None


def test_interval_energy_per_gpu_per_iteration_and_power(monkeypatch) -> None:
    readings = iter([10.0, 70.0])
    clock = iter([100.0, 104.0])
    monkeypatch.setattr(energy.time, "monotonic", lambda: next(clock))
    monitor = EnergyMonitor(lambda: next(readings))
    # 60 J over 4 s on 3 ranks (as if summed across them), 5 iterations: 4 J/iter/GPU, 5 W/GPU
    result = interval_energy(monitor, iterations=5, world_size=3)
    assert result == pytest.approx({"energy_per_gpu_j_per_iter": 4.0, "power_per_gpu_w": 5.0})
    assert interval_energy(None, 5, 3) is None


def test_log_energy_is_device_dependent() -> None:
    assert field_status("logger", "log_energy") == DEVICE


def test_without_counters_it_is_listed_not_applicable_and_logs_nothing(tmp_path, monkeypatch, captured):
    monkeypatch.setattr(energy, "POWERCAP_ROOT", tmp_path / "no-powercap")
    cfg = small_config(tmp_path, train_iters=3)
    cfg.logger.log_energy = True
    pretrain(cfg, forward_step)
    text = "\n".join(captured)
    assert "not applicable on this machine (ignored): " in text and "logger.log_energy=True" in text
    assert "energy per GPU" not in text
    assert all("energy_per_gpu_j_per_iter" not in r for r in read_metrics(cfg))


def test_with_a_counter_the_run_logs_energy(tmp_path, monkeypatch, captured):
    root = tmp_path / "powercap"
    zone = _zone(root, "intel-rapl:0", 0, 10**12)
    monkeypatch.setattr(energy, "POWERCAP_ROOT", root)
    real_read = RaplCounter._read_uj

    def growing(z: Path) -> int:  # every read finds 1 J more than the last one
        value = real_read(z) + 1_000_000
        _set(z, value)
        return value

    monkeypatch.setattr(RaplCounter, "_read_uj", staticmethod(growing))
    cfg = small_config(tmp_path, train_iters=4)
    cfg.logger.log_energy = True
    cfg.logger.log_interval = 2
    pretrain(cfg, forward_step)
    text = "\n".join(captured)
    assert "logger.log_energy" not in text
    assert text.count("energy per GPU (J/iter/GPU): 0.5 |") == 2 and "power per GPU (W/GPU): " in text
    records = {r["iteration"]: r for r in read_metrics(cfg)}
    # one lap per log interval (2 iterations): 1 J, so 0.5 J per iteration
    assert [i for i, r in records.items() if "energy_per_gpu_j_per_iter" in r] == [2, 4]
    for i in (2, 4):
        assert records[i]["energy_per_gpu_j_per_iter"] == pytest.approx(0.5)
        assert records[i]["power_per_gpu_w"] > 0
    assert int(zone.joinpath("energy_uj").read_text()) >= 3_000_000
    # TensorBoard gets Megatron's tags at each log interval
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(cfg.logger.tensorboard_dir, size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("iter-energy/gpu")] == [(2, 0.5), (4, 0.5)]
    assert [e.step for e in events.Scalars("power/gpu")] == [2, 4]


def _two_rank_energy(root: str, joules_per_read: float):
    """On each rank: a monitor over this rank's fake tree (none when root is empty), and one lap."""
    import longspan.training.observability.energy as energy

    energy.POWERCAP_ROOT = Path(root)
    init_gloo()
    monitor = energy.build_energy_monitor()
    if monitor is None:
        return None
    zone = Path(root) / "intel-rapl:0"
    zone.joinpath("energy_uj").write_text(str(int(joules_per_read * 1e6)))
    return monitor.lap()[0]


@pytest.mark.slow
def test_ranks_sum_their_energy_and_agree_on_having_counters(tmp_path: Path) -> None:
    roots = []
    for rank in range(2):
        _zone(tmp_path / f"rank{rank}", "intel-rapl:0", 0, 10**12)
        roots.append(str(tmp_path / f"rank{rank}"))
    pool = get_shared_pool(2)
    # 3 J on rank 0 and 5 J on rank 1: every rank's lap is the sum
    assert pool.run_per_rank(_two_rank_energy, [(roots[0], 3.0), (roots[1], 5.0)]) == [8.0, 8.0]
    # rank 1 has no readable counter: no rank monitors (a lap would be a collective the other never joins)
    missing = str(tmp_path / "none")
    assert pool.run_per_rank(_two_rank_energy, [(roots[0], 1.0), (missing, 1.0)]) == [None, None]
