"""Non-persistent checkpoints: local per-rank saves survive SIGKILL; global ones are cleaned up; resume takes
the newest complete checkpoint of any kind."""

from __future__ import annotations

import random
import shutil
import signal
from pathlib import Path

import pytest

from longspan.cli import main
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.training.pretrain import pretrain
from longspan.training.checkpointing.non_persistent import local_iterations
from tests.resilience.helpers import resilience_config, run_and_kill_at, write_yaml
from tests.training.pretrain_helpers import losses_by_iteration, read_metrics


ITERS = 20


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    cfg = resilience_config(tmp_path_factory.mktemp("ref"), "ref", ITERS)
    pretrain(cfg)
    losses = losses_by_iteration(cfg)
    assert sorted(losses) == list(range(1, ITERS + 1))
    return losses


@pytest.mark.slow
def test_local_checkpoint_resume_after_sigkill_matches_uninterrupted_run(tmp_path: Path, reference_losses,
                                                                         capfd: pytest.CaptureFixture) -> None:
    cfg = resilience_config(tmp_path, "np", ITERS)
    ckpt = cfg.checkpoint
    ckpt.non_persistent_ckpt_type = "local"
    ckpt.non_persistent_save_interval = 3
    ckpt.non_persistent_local_ckpt_dir = str(tmp_path / "node_local")
    config = write_yaml(cfg, tmp_path / "np.yaml")
    kill_at = random.Random().randint(4, ITERS - 6)
    code, killed_at = run_and_kill_at(["pretrain", "--config", str(config)], cfg, kill_at)
    assert code == -signal.SIGKILL, f"the run was not killed (exit {code})"
    saved = local_iterations(ckpt)
    assert len(saved) == 1 and saved[0] % 3 == 0 and saved[0] <= killed_at  # older saves were cleaned up
    assert not Path(ckpt.save, "latest_checkpointed_iteration.txt").exists()  # no persistent save yet

    assert main(["pretrain", "--config", str(config)]) == 0  # the same command again, in this process
    captured = capfd.readouterr()
    log = captured.out + captured.err
    assert f"loaded local non-persistent checkpoint of iteration {saved[0]}" in log
    losses = losses_by_iteration(cfg)  # re-run iterations overwrite the killed run's records
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert losses == reference_losses  # bit-exact, dropout on


@pytest.mark.slow
def test_global_checkpoints_are_cleaned_and_the_newest_kind_is_resumed(tmp_path: Path, reference_losses) -> None:
    """Global non-persistent saves every 2 iterations (older ones removed), persistent every 5. A run stopped
    after 6 whose persistent save of 6 is lost resumes from the non-persistent 6, not the persistent 5."""
    cfg = resilience_config(tmp_path, "g", ITERS)
    ckpt = cfg.checkpoint
    ckpt.non_persistent_ckpt_type = "global"
    ckpt.non_persistent_save_interval = 2
    ckpt.save_interval = 5
    cfg.train.exit_interval = 6
    pretrain(cfg)
    np_root = Path(ckpt.save) / "non_persistent"
    assert sorted(p.name for p in np_root.glob("iter_*")) == ["iter_0000006"]
    assert (np_root / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    root = Path(ckpt.save)
    shutil.rmtree(root / "iter_0000006")  # the exit-interval save is lost: persistent 5 remains
    (root / "latest_checkpointed_iteration.txt").write_text("5")

    cfg.train.exit_interval = None
    state = pretrain(cfg)
    assert state.train_state.step == ITERS
    records = read_metrics(cfg)
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))  # resumed at 7: 6 was not re-run
    assert losses_by_iteration(cfg) == reference_losses


@pytest.mark.parametrize(
    "fields, error, match",
    [
        ({"non_persistent_ckpt_type": "in_memory", "non_persistent_save_interval": 2}, NotSupportedError, "in_memory"),
        ({"non_persistent_ckpt_type": "local", "non_persistent_save_interval": 2}, ConfigError,
         "non_persistent_local_ckpt_dir"),
        ({"non_persistent_save_interval": 2}, ConfigError, "non_persistent_ckpt_type"),
        ({"non_persistent_ckpt_type": "global"}, ConfigError, "non_persistent_save_interval"),
        ({"non_persistent_ckpt_type": "global", "non_persistent_save_interval": 0}, ConfigError,
         "non_persistent_save_interval"),
    ],
)
def test_bad_non_persistent_settings_are_rejected(tmp_path: Path, fields, error, match) -> None:
    cfg = resilience_config(tmp_path, "bad", 4)
    for key, value in fields.items():
        setattr(cfg.checkpoint, key, value)
    with pytest.raises(error, match=match):
        cfg.validate(world_size=1)
