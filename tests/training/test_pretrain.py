"""The single-process trainer end to end: resume bit for bit, checkpoint layout, exits, NaN stops, bad input."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import torch

from longspan.cli import main as cli_main
from longspan.core.errors import CheckpointError
from longspan.training.step.forward_step import forward_step
from longspan.training.pretrain import pretrain
from longspan.training.step.schedules import TrainingDivergedError
from tests.training.pretrain_helpers import (
    losses_by_iteration,
    read_metrics,
    small_config,
    with_dropout_and_real_data,
    write_token_corpus,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real indexed dataset with uneven documents (prefix)."""
    return write_token_corpus(tmp_path_factory.mktemp("corpus"))


def resumable_config(tmp_path: Path, name: str, corpus: str, **train_overrides):
    """The small config with hidden and attention dropout on, over real data: resuming must restore the RNG
    (dropout masks) and the data position exactly, or the losses drift."""
    return with_dropout_and_real_data(small_config(tmp_path, name, **train_overrides), corpus)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory, corpus: str):
    """30 uninterrupted iterations: the reference every resume must reproduce exactly."""
    tmp = tmp_path_factory.mktemp("straight")
    cfg = resumable_config(tmp, "straight", corpus)
    cfg.logger.log_progress = True
    state = pretrain(cfg, forward_step)
    return cfg, state, losses_by_iteration(cfg)


def test_run_trains_and_writes_megatron_checkpoint_layout(straight_run) -> None:
    cfg, state, losses = straight_run
    assert state.train_state.step == 30
    assert sorted(losses) == list(range(1, 31))
    first, last = sum(losses[i] for i in range(1, 6)) / 5, sum(losses[i] for i in range(26, 31)) / 5
    assert last < first  # it learns something even on mock data
    root = Path(cfg.checkpoint.save)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "30"
    ckpt = root / "iter_0000030"
    assert (ckpt / ".metadata").is_file()
    assert list(ckpt.glob("__*_*.distcp"))
    for name in ("train_state.pt", "run_config.yaml", "metadata.json"):
        assert (ckpt / name).is_file(), name
    assert (root / "latest_train_state.pt").is_file()
    train_state = torch.load(ckpt / "train_state.pt", weights_only=True)
    assert int(train_state["step"]) == 30
    assert int(train_state["consumed_train_samples"]) == 30 * 8
    progress = (root / "progress.txt").read_text().splitlines()
    assert "Starting job" in progress[0]
    assert any("Saved checkpoint\tIteration: 30\t" in line for line in progress)


@pytest.mark.slow
def test_exit_interval_and_resume_continue_bit_for_bit(tmp_path: Path, straight_run, corpus) -> None:
    _, _, reference = straight_run
    cfg = resumable_config(tmp_path, "resumed", corpus, exit_interval=15)
    state = pretrain(cfg, forward_step)
    assert state.train_state.step == 15
    assert (Path(cfg.checkpoint.save) / "latest_checkpointed_iteration.txt").read_text() == "15"

    cfg2 = resumable_config(tmp_path, "resumed", corpus)  # same directories: the rerun resumes from iteration 15
    state2 = pretrain(cfg2, forward_step)
    assert state2.train_state.step == 30
    resumed = losses_by_iteration(cfg2)
    assert sorted(resumed) == list(range(1, 31))
    assert [resumed[i] for i in range(1, 31)] == [reference[i] for i in range(1, 31)]


@pytest.mark.slow
def test_resume_without_the_rng_restore_drifts(tmp_path: Path, straight_run, corpus, monkeypatch) -> None:
    """The control that makes the resume tests meaningful: with dropout on, skipping the RNG restore changes
    the losses after the resume (so a no-op restore cannot pass them)."""
    import longspan.training.setup as setup_module

    _, _, reference = straight_run
    pretrain(resumable_config(tmp_path, "norng", corpus, exit_interval=15), forward_step)
    monkeypatch.setattr(setup_module, "set_rng_state", lambda state: None)
    cfg2 = resumable_config(tmp_path, "norng", corpus)
    pretrain(cfg2, forward_step)
    resumed = losses_by_iteration(cfg2)
    assert [resumed[i] for i in range(1, 16)] == [reference[i] for i in range(1, 16)]
    assert [resumed[i] for i in range(16, 31)] != [reference[i] for i in range(16, 31)]


@pytest.mark.slow
def test_signal_saves_and_exits_then_resumes(tmp_path: Path, straight_run, corpus) -> None:
    _, _, reference = straight_run

    def signalling_forward_step(state, data_iterator, model):
        if state.train_state.step == 7 and not getattr(state, "_signalled", False):
            state._signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
        return forward_step(state, data_iterator, model)

    cfg = resumable_config(tmp_path, "sig", corpus, exit_signal_handler=True)
    state = pretrain(cfg, signalling_forward_step)
    assert state.train_state.step == 8  # the iteration in flight completes, then save and exit
    assert (Path(cfg.checkpoint.save) / "latest_checkpointed_iteration.txt").read_text() == "8"
    assert signal.getsignal(signal.SIGTERM) is not None

    state2 = pretrain(resumable_config(tmp_path, "sig", corpus), forward_step)
    assert state2.train_state.step == 30
    resumed = losses_by_iteration(resumable_config(tmp_path, "sig", corpus))
    assert [resumed[i] for i in range(1, 31)] == [reference[i] for i in range(1, 31)]


def test_per_token_loss_matches_default_when_token_counts_are_equal(tmp_path: Path) -> None:
    runs = {}
    for per_token in (False, True):
        cfg = small_config(tmp_path, f"even_{per_token}", train_iters=5)
        cfg.model.calculate_per_token_loss = per_token
        cfg.checkpoint.save = cfg.checkpoint.load = None
        pretrain(cfg, forward_step)
        runs[per_token] = losses_by_iteration(cfg)
    for i in range(1, 6):  # mock data without EOD masking: every microbatch counts the same tokens
        assert runs[True][i] == pytest.approx(runs[False][i], rel=1e-6)


def test_per_token_loss_weights_microbatches_by_their_tokens(tmp_path: Path) -> None:
    """With end-of-document tokens masked, microbatches count different numbers of loss tokens. The per-token
    loss averages over all tokens of the global batch, Megatron's default over microbatch means: iteration 1
    starts from the same weights, so both log Σloss/Σmask, then their gradients, and so their losses, differ."""
    from longspan.training.step.forward_step import get_batch

    counts = []

    def counting_forward_step(state, data_iterator, model):
        batch = get_batch(data_iterator, state.device)
        counts.append(int(batch["loss_mask"].sum()))
        return forward_step(state, iter([batch]), model)

    # Documents of 1 or 30 tokens, one sequence per microbatch: microbatches hold different numbers of EODs.
    corpus = write_token_corpus(tmp_path / "uneven", documents=1500, lengths=(1, 1, 1, 1, 30))
    runs = {}
    for per_token in (False, True):
        cfg = with_dropout_and_real_data(small_config(tmp_path, f"uneven_{per_token}", train_iters=5), corpus, 0.0)
        cfg.train.micro_batch_size = 1
        cfg.model.calculate_per_token_loss = per_token
        cfg.optimizer.optimizer, cfg.optimizer.lr, cfg.optimizer.clip_grad = "sgd", 0.5, 0.0  # update ∝ gradient
        cfg.scheduler.lr_warmup_iters = 0
        cfg.checkpoint.save = cfg.checkpoint.load = None
        counts.clear()
        pretrain(cfg, counting_forward_step)
        runs[per_token] = losses_by_iteration(cfg)
    assert max(counts[:8]) - min(counts[:8]) >= 4, counts  # the first iteration's microbatches differ
    assert runs[True][1] == pytest.approx(runs[False][1], rel=1e-6)
    assert all(runs[True][i] != pytest.approx(runs[False][i], rel=1e-5) for i in range(2, 6)), runs


def test_nan_loss_stops_without_checkpoint(tmp_path: Path) -> None:
    def nan_forward_step(state, data_iterator, model):
        output, loss_func = forward_step(state, data_iterator, model)
        if state.train_state.step == 2:
            output = output * float("nan")
        return output, loss_func

    cfg = small_config(tmp_path, "nan", train_iters=5)
    cfg.checkpoint.save_interval = 1
    with pytest.raises(TrainingDivergedError, match="iteration 3"):
        pretrain(cfg, nan_forward_step)
    assert (Path(cfg.checkpoint.save) / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_rampup_batch_size_follows_megatron_schedule(tmp_path: Path) -> None:
    cfg = small_config(
        tmp_path, "rampup", train_iters=None, train_samples=36, rampup_batch_size=[4, 2, 16], eval_interval=None
    )
    cfg.scheduler.lr_warmup_iters = 0
    cfg.scheduler.lr_warmup_samples = 8
    cfg.checkpoint.save = None
    cfg.checkpoint.load = None
    state = pretrain(cfg, forward_step)
    sizes = [r["batch_size"] for r in read_metrics(cfg)]
    # start 4, +2 per (16 / ((8-4)/2)) = 8 samples, full size once 16 samples are consumed
    consumed, expected = 0, []
    for _ in range(6):
        size = 8 if consumed > 16 else 4 + 2 * int(consumed / 8)
        expected.append(size)
        consumed += size
    assert sizes == expected
    assert state.train_state.consumed_train_samples == sum(expected)


def test_missing_checkpoint_with_exit_on_missing_is_one_line(tmp_path: Path, capsys) -> None:
    code = cli_main(
        [
            "pretrain", "--recipe", "tiny", "tokenizer.tokenizer_type=NullTokenizer", "tokenizer.tokenizer_model=null",
            "tokenizer.vocab_size=255", "model.vocab_size=null", "dataset.data_path=null",
            f"checkpoint.load={tmp_path / 'nowhere'}", "checkpoint.exit_on_missing_checkpoint=true",
            f"checkpoint.save={tmp_path / 'save'}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "nowhere" in err[0] and "Traceback" not in err[0]


def test_checkpoint_of_another_shape_names_the_tensor(tmp_path: Path, straight_run) -> None:
    cfg_ref, _, _ = straight_run
    cfg = small_config(tmp_path, "shape", train_iters=31)
    cfg.checkpoint.load = cfg_ref.checkpoint.save
    cfg.model.hidden_size = 128
    with pytest.raises(CheckpointError, match=r"shape \(\d+, 64\).*\(\d+, 128\)"):
        pretrain(cfg, forward_step)


def test_unwritable_save_directory_is_one_line(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code = cli_main(
        [
            "pretrain", "--recipe", "tiny", "tokenizer.tokenizer_type=NullTokenizer", "tokenizer.tokenizer_model=null",
            "tokenizer.vocab_size=255", "model.vocab_size=null", "dataset.data_path=null",
            f"checkpoint.save={blocker / 'ckpt'}", "checkpoint.load=null",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "checkpoint.save" in err[0]


def test_validation_loss_is_logged(straight_run) -> None:
    cfg, state, _ = straight_run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(cfg.logger.tensorboard_dir)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "lm loss validation"} <= tags
    values = [e.value for e in acc.Scalars("lm loss validation")]
    # iterations 10, 20, 30, then the test split (Megatron writes it under the same tag)
    assert [e.step for e in acc.Scalars("lm loss validation")] == [10, 20, 30, 30]
    assert all(math.isfinite(v) for v in values)


def test_use_checkpoint_args_takes_the_saved_architecture(tmp_path: Path, straight_run) -> None:
    cfg_ref, _, reference = straight_run
    cfg = small_config(tmp_path, "ckpt_args", train_iters=32, eval_interval=None)
    cfg.checkpoint.load = cfg_ref.checkpoint.save
    cfg.checkpoint.use_checkpoint_args = True
    cfg.scheduler.override_opt_param_scheduler = True  # a longer run than the checkpoint's schedule
    cfg.model.hidden_size = 128  # would not fit the checkpoint; the saved value wins
    cfg.model.ffn_hidden_size = 256
    state = pretrain(cfg, forward_step)
    assert cfg.model.hidden_size == 64 and cfg.model.ffn_hidden_size == 128
    assert state.train_state.step == 32


@pytest.mark.slow
def test_async_save_writes_trackers_after_completion_and_resumes(tmp_path: Path, straight_run, corpus) -> None:
    _, _, reference = straight_run
    cfg = resumable_config(tmp_path, "async", corpus, exit_interval=15)
    cfg.checkpoint.async_save = True
    cfg.checkpoint.save_interval = 5
    pretrain(cfg, forward_step)
    root = Path(cfg.checkpoint.save)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "15"
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000005", "iter_0000010", "iter_0000015"]
    assert not list(root.glob("*.partial"))
    cfg2 = resumable_config(tmp_path, "async", corpus)
    cfg2.checkpoint.async_save = True
    pretrain(cfg2, forward_step)
    resumed = losses_by_iteration(cfg2)
    assert [resumed[i] for i in range(16, 31)] == [reference[i] for i in range(16, 31)]


@pytest.mark.slow
def test_interrupt_mid_save_keeps_the_previous_checkpoint_loadable(tmp_path: Path, monkeypatch) -> None:
    import longspan.training.checkpointing.save as ckpt_module

    cfg = small_config(tmp_path, "interrupt", train_iters=4, eval_interval=None)
    cfg.checkpoint.save_interval = 2
    real_save = ckpt_module.dcp.save
    calls = {"n": 0}

    def save_then_interrupt(state_dict, *, checkpoint_id, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second save (iteration 4) dies half way, like a Ctrl-C
            Path(checkpoint_id, "__0_0.distcp").write_bytes(b"partial")
            raise KeyboardInterrupt
        return real_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(ckpt_module.dcp, "save", save_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        pretrain(cfg, forward_step)
    root = Path(cfg.checkpoint.save)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (root / "iter_0000004").exists()
    monkeypatch.setattr(ckpt_module.dcp, "save", real_save)
    state = pretrain(small_config(tmp_path, "interrupt", train_iters=4, eval_interval=None), forward_step)
    assert state.train_state.step == 4  # resumed from 2; the stale partial directory was replaced
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert not list(root.glob("*.partial"))


def test_resuming_an_earlier_runs_checkpoint_with_another_schedule_says_so_first(tmp_path: Path, capsys) -> None:
    """The quickstart, then the same recipe continued to 8 iterations: with another warmup too, the run would
    resume the earlier checkpoint on a changed schedule, and the one-line error says that first and how to start
    fresh; with only the longer train_iters, the run continues from iteration 4 on the config's schedule."""
    cfg = small_config(tmp_path, "earlier", train_iters=4)
    cfg.checkpoint.save_interval = 4
    pretrain(cfg, forward_step)
    path = tmp_path / "again.yaml"
    again = small_config(tmp_path, "earlier", train_iters=8)
    again.scheduler.lr_warmup_iters = 2
    path.write_text(again.to_yaml())
    capsys.readouterr()
    code = cli_main(["pretrain", "--config", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"longspan: error: resuming the checkpoint at iteration 4 in {cfg.checkpoint.save}")
    assert "warmup (scheduler.lr_warmup_iters): this config gives 2 iterations, the checkpoint 3 iterations" in err
    assert err.endswith("to start fresh instead, set checkpoint.load=null or use another checkpoint.save directory")

    longer = small_config(tmp_path, "earlier", train_iters=8)
    longer.checkpoint.save_interval = 4
    path.write_text(longer.to_yaml())
    assert cli_main(["pretrain", "--config", str(path)]) == 0
    out = capsys.readouterr()
    assert "train.train_iters=8, the checkpoint's schedule was for 4" in out.out + out.err
    assert (Path(cfg.checkpoint.save) / "latest_checkpointed_iteration.txt").read_text() == "8"
