"""Bad input through ``longspan pretrain`` / ``preprocess``: one line on stderr, exit 2, no traceback, and
nothing written to the save directory.

Most cases run in-process through ``longspan.cli.main`` (fast); two run as real subprocesses to prove the
exit code and the absence of a traceback end to end.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from longspan.cli import main
from longspan.training.step.forward_step import forward_step
from longspan.training.pretrain import pretrain
from tests.helpers.cli_errors import assert_one_line
from tests.training.pretrain_helpers import small_config

# (overrides, a fragment the one-line message must contain)
CONFIG_CASES: list[tuple[list[str], str]] = [
    (["model.vocab_size=-3"], "model.vocab_size=-3 is out of range: use a positive integer"),
    (["model.vocab_size=10"], "model.vocab_size=10 is smaller than the tokenizer's vocabulary (256 ids)"),
    (["dataset.sequence_length=0", "model.seq_length=0"], "model.seq_length=0 is out of range"),
    (["optimizer.adam_beta1=5"], "optimizer.adam_beta1=5.0 is out of range: use a number in [0, 1)"),
    (["optimizer.adam_beta2=1.0"], "optimizer.adam_beta2=1.0 is out of range"),
    (["optimizer.adam_eps=0"], "optimizer.adam_eps=0.0 is out of range: use a number > 0"),
    (["train.exit_signal=99999"], "train.exit_signal=99999 is not a signal of this platform"),
    (["model.ffn_hidden_size=0"], "model.ffn_hidden_size=0 is out of range"),
    (["model.num_query_groups=0"], "model.num_query_groups=0 is out of range"),
    (["model.make_vocab_size_divisible_by=0"], "model.make_vocab_size_divisible_by=0 is out of range"),
    (["scheduler.lr_warmup_iters=40"], "scheduler warmup (40 iterations) is not shorter than the decay (30 iterations)"),
    (["model.hidden_size=-64"], "model.hidden_size=-64 is out of range"),
    (["model.num_layers=0"], "model.num_layers=0 is out of range"),
    (["model.num_attention_heads=0"], "model.num_attention_heads=0 is out of range"),
    (["model.kv_channels=0"], "model.kv_channels=0 is out of range"),
    (["model.hidden_dropout=1.5"], "model.hidden_dropout=1.5 is out of range: use a number in [0, 1]"),
    (["model.attention_dropout=-0.1"], "model.attention_dropout=-0.1 is out of range"),
    (["model.layernorm_epsilon=0"], "model.layernorm_epsilon=0.0 is out of range"),
    (["model.init_method_std=-1"], "model.init_method_std=-1.0 is out of range"),
    (["model.rotary_percent=0"], "model.rotary_percent=0.0 is out of range"),
    (["model.rotary_base=-1"], "model.rotary_base=-1 is out of range"),
    (["model.num_attention_heads=3"], "model.num_attention_heads=3 is not divisible by model.num_query_groups=2"),
    (["train.micro_batch_size=0"], "train.micro_batch_size=0 is out of range"),
    (["train.global_batch_size=-8"], "train.global_batch_size=-8 is out of range"),
    (["train.train_iters=-1"], "train.train_iters=-1 is out of range"),
    (["train.train_iters=abc"], "train.train_iters='abc' has the wrong type"),
    (["train.eval_iters=-2"], "train.eval_iters=-2 is out of range"),
    (["train.eval_interval=0"], "train.eval_interval=0 is out of range"),
    (["train.exit_interval=0"], "train.exit_interval=0 is out of range"),
    (["optimizer.lr=-0.1"], "optimizer.lr=-0.1 is out of range"),
    (["optimizer.lr=.nan"], "optimizer.lr=nan is out of range"),
    (["optimizer.min_lr=-1"], "optimizer.min_lr=-1.0 is out of range"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay=-0.1 is out of range"),
    (["optimizer.clip_grad=-1"], "optimizer.clip_grad=-1.0 is out of range"),
    (["optimizer.sgd_momentum=2"], "optimizer.sgd_momentum=2.0 is out of range"),
    (["scheduler.lr_warmup_iters=0", "scheduler.lr_warmup_fraction=1.5"], "lr_warmup_fraction=1.5 is out of range"),
    (["scheduler.lr_decay_iters=0"], "scheduler.lr_decay_iters=0 is out of range"),
    (["scheduler.lr_decay_style=cosin"], "choose one of 'constant'"),
    (["dataset.num_workers=-1"], "dataset.num_workers=-1 is out of range"),
    (["dataset.random_seed=-5"], "dataset.random_seed=-5 is out of range"),
    (["logger.log_interval=0"], "logger.log_interval=0 is out of range"),
    (["checkpoint.save_interval=0"], "checkpoint.save_interval=0 is out of range"),
    (["checkpoint.ckpt_format=zarr"], "checkpoint.ckpt_format='zarr' is not supported yet by longspan"),
    (["rng.seed=-1"], "rng.seed=-1 is out of range"),
    (["dist.distributed_timeout_minutes=0"], "dist.distributed_timeout_minutes=0 must be a positive number of minutes"),
    (["tokenizer.vocab_size=0"], "tokenizer.vocab_size=0: NullTokenizer needs a positive vocab_size"),
]


def _write_base(directory: Path) -> tuple[Path, Path]:
    """The small trainer config as YAML; returns (config file, save directory)."""
    cfg = small_config(directory, "run", train_iters=30)
    path = directory / "base.yaml"
    path.write_text(cfg.to_yaml())
    return path, Path(cfg.checkpoint.save)


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    if not directory.exists():
        return {}
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
    }


@pytest.mark.parametrize("overrides,fragment", CONFIG_CASES, ids=[" ".join(o) for o, _ in CONFIG_CASES])
def test_bad_config_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, overrides: list[str], fragment: str
) -> None:
    base, save = _write_base(tmp_path)
    code = main(["pretrain", "--config", str(base), *overrides])
    assert_one_line(code, capsys.readouterr().err, fragment)
    assert not save.exists(), sorted(save.rglob("*"))


# --- damaged checkpoints --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-iteration checkpoint of the small config (save root with tracker and iter_0000002)."""
    tmp = tmp_path_factory.mktemp("good")
    cfg = small_config(tmp, "run", train_iters=2)
    cfg.scheduler.lr_warmup_iters = 1
    cfg.checkpoint.save_interval = 2
    pretrain(cfg, forward_step)
    return Path(cfg.checkpoint.save)


def _random_metadata(iter_dir: Path) -> str:
    (iter_dir / ".metadata").write_bytes(os.urandom(300))
    return f"{iter_dir / '.metadata'} (DCP metadata) cannot be read"


def _random_pickle_metadata(iter_dir: Path) -> str:
    # Starts like a protocol-4 pickle, so the unpickler itself meets the random opcodes.
    (iter_dir / ".metadata").write_bytes(b"\x80\x04" + os.urandom(300))
    return f"{iter_dir / '.metadata'} (DCP metadata) cannot be read"


def _hostile_metadata(iter_dir: Path) -> str:
    class Hostile:
        def __reduce__(self):  # noqa: D105 - a pickle that would run a command when loaded unsafely
            return (os.system, ("echo pwned > /dev/null",))

    (iter_dir / ".metadata").write_bytes(pickle.dumps(Hostile()))
    return "refers to posix.system, which DCP metadata never holds"


def _truncated_shard(iter_dir: Path) -> str:
    shard = sorted(iter_dir.glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return f"{shard} (a DCP shard) is truncated: {len(data) // 2} bytes"


def _missing_shard(iter_dir: Path) -> str:
    shard = sorted(iter_dir.glob("*.distcp"))[0]
    shard.unlink()
    return f"{shard} (a DCP shard) is missing"


def _corrupt_shard_bytes(iter_dir: Path) -> str:
    shard = sorted(iter_dir.glob("*.distcp"))[0]
    size = shard.stat().st_size
    shard.write_bytes(os.urandom(size))
    return f"{iter_dir} (DCP shards) cannot be read"


def _missing_train_state(iter_dir: Path) -> str:
    (iter_dir / "train_state.pt").unlink()
    return f"{iter_dir / 'train_state.pt'} (training progress) is missing"


def _garbage_train_state(iter_dir: Path) -> str:
    (iter_dir / "train_state.pt").write_bytes(b"\x00garbage" * 20)
    return f"{iter_dir / 'train_state.pt'} (training progress) cannot be read"


def _hostile_train_state(iter_dir: Path) -> str:
    class Hostile:
        def __reduce__(self):  # noqa: D105
            return (os.system, ("echo pwned > /dev/null",))

    torch.save({"step": Hostile()}, iter_dir / "train_state.pt")
    return f"{iter_dir / 'train_state.pt'} (training progress) cannot be read"


def _train_state_without_step(iter_dir: Path) -> str:
    torch.save({"consumed_train_samples": 3}, iter_dir / "train_state.pt")
    return "without a 'step' entry"


def _garbage_tracker(iter_dir: Path) -> str:
    (iter_dir.parent / "latest_checkpointed_iteration.txt").write_text("two\n")
    return "holds 'two'; expected an iteration number"


DAMAGES: dict[str, Callable[[Path], str]] = {
    "random bytes in .metadata": _random_metadata,
    "random pickle opcodes in .metadata": _random_pickle_metadata,
    "hostile pickle in .metadata": _hostile_metadata,
    "truncated .distcp shard": _truncated_shard,
    "missing .distcp shard": _missing_shard,
    "random bytes in a .distcp shard": _corrupt_shard_bytes,
    "missing train_state.pt": _missing_train_state,
    "garbage train_state.pt": _garbage_train_state,
    "hostile train_state.pt": _hostile_train_state,
    "train_state.pt without step": _train_state_without_step,
    "garbage tracker": _garbage_tracker,
}


@pytest.mark.parametrize("damage", list(DAMAGES), ids=list(DAMAGES))
def test_damaged_checkpoint_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture, good_checkpoint: Path, damage: str
) -> None:
    base, _ = _write_base(tmp_path)
    root = tmp_path / "ckpt"
    shutil.copytree(good_checkpoint, root)
    fragment = DAMAGES[damage](root / "iter_0000002")
    before = _snapshot(root)
    code = main(["pretrain", "--config", str(base), f"checkpoint.load={root}", f"checkpoint.save={root}",
                 "train.train_iters=2", "scheduler.lr_warmup_iters=1"])
    assert_one_line(code, capsys.readouterr().err, fragment)
    assert _snapshot(root) == before


# --- preprocess -----------------------------------------------------------------------------------------------

PREPROCESS_CASES = [
    (["--workers", "-3"], "argument --workers: -3 must be a positive integer"),
    (["--workers", "0"], "argument --workers: 0 must be a positive integer"),
    (["--partitions", "0"], "argument --partitions: 0 must be a positive integer"),
    (["--log-interval", "-1"], "argument --log-interval: -1.0 must be a positive number"),
]


@pytest.mark.parametrize("extra,fragment", PREPROCESS_CASES, ids=[" ".join(e) for e, _ in PREPROCESS_CASES])
def test_bad_preprocess_argument_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, extra: list[str], fragment: str
) -> None:
    (tmp_path / "in.jsonl").write_text('{"text": "1 2 3"}\n')
    out = tmp_path / "out" / "data"
    with pytest.raises(SystemExit) as exc:
        main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(out),
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "16", *extra])
    assert_one_line(int(exc.value.code), capsys.readouterr().err, fragment)
    assert not out.parent.exists()


def test_there_are_at_least_40_bad_inputs() -> None:
    assert len(CONFIG_CASES) + len(DAMAGES) + len(PREPROCESS_CASES) >= 40


# --- as a real process ----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["config", "checkpoint"])
def test_subprocess_exit_code_and_no_traceback(tmp_path: Path, good_checkpoint: Path, kind: str) -> None:
    base, save = _write_base(tmp_path)
    if kind == "config":
        args, fragment = ["model.vocab_size=-3"], "model.vocab_size=-3 is out of range"
    else:
        root = tmp_path / "ckpt"
        shutil.copytree(good_checkpoint, root)
        fragment = _truncated_shard(root / "iter_0000002")
        args = [f"checkpoint.load={root}", f"checkpoint.save={root}", "train.train_iters=2", "scheduler.lr_warmup_iters=1"]
        save = root
    before = _snapshot(save)
    proc = subprocess.run(
        [sys.executable, "-m", "longspan", "pretrain", "--config", str(base), *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert_one_line(proc.returncode, proc.stderr, fragment)
    assert _snapshot(save) == before
