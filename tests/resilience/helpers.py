"""Subprocess helpers for the resilience tests: run ``longspan pretrain`` on a YAML and kill it mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.training.pretrain_helpers import small_config

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
LONGSPAN = [sys.executable, "-m", "longspan"]


def resilience_config(tmp_path: Path, name: str, train_iters: int) -> Any:
    """small_config with dropout on and no evaluation (quick runs whose losses depend on the RNG)."""
    cfg = small_config(tmp_path, name, train_iters=train_iters, eval_interval=None)
    cfg.model.hidden_dropout = 0.1
    cfg.model.attention_dropout = 0.1
    return cfg


def write_yaml(cfg: Any, path: Path) -> Path:
    cfg.to_yaml(str(path))
    return path


def metrics_records(cfg: Any) -> list[dict[str, Any]]:
    path = Path(cfg.logger.tensorboard_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short by SIGKILL
            continue
    return out


def last_logged_iteration(cfg: Any) -> int:
    its = [r["iteration"] for r in metrics_records(cfg) if r.get("phase", "train") == "train" and "iteration" in r]
    return max(its, default=0)


def run_and_kill_at(args: list[str], cfg: Any, iteration: int, sig: int = signal.SIGKILL,
                    timeout: float = 120.0) -> tuple[int, int]:
    """Start ``longspan <args>``, send ``sig`` once iteration ``iteration`` is logged; (returncode, killed at)."""
    proc = subprocess.Popen(LONGSPAN + args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and proc.poll() is None:
            at = last_logged_iteration(cfg)
            if at >= iteration:
                proc.send_signal(sig)
                return proc.wait(timeout=60), at
            time.sleep(0.01)
        return proc.wait(timeout=5), last_logged_iteration(cfg)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(LONGSPAN + args, env=ENV, capture_output=True, text=True, timeout=timeout)
