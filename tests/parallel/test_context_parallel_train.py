"""Context parallel through the real trainer: ``pretrain(cfg)`` under CP2 logs the
losses of one process with the same global batch, and the config checks that come with CP."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from longspan.core.errors import ConfigError
from tests.training.pretrain_helpers import losses_by_iteration, read_metrics, small_config

ITERS = 8
REL_TOL = 1e-4


def cp_config(tmp_path: Path, name: str, cp: int = 1):
    """``tiny`` shrunk (2 layers, hidden 64, GQA 4/2, seq 64), mock data, 8 iterations of 4 × 2 samples."""
    cfg = small_config(tmp_path, name, train_iters=ITERS, eval_iters=0)
    cfg.model.context_parallel_size = cp
    cfg.checkpoint.save = None
    cfg.checkpoint.load = None
    cfg.dist.distributed_backend = "gloo"
    cfg.dist.distributed_timeout_minutes = 1
    return cfg


def assert_same_run(got_cfg, want_cfg, name: str) -> None:
    """Same logged losses (1e-4 relative) and gradient norms (1e-3: Adam hides gradient scale errors in the
    losses, the norm does not) in every one of the ITERS iterations."""
    got, want = losses_by_iteration(got_cfg), losses_by_iteration(want_cfg)
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    for it in want:
        assert math.isclose(got[it], want[it], rel_tol=REL_TOL), f"{name} iteration {it}: {got[it]} vs {want[it]}"
    assert want[ITERS] < want[1]  # the model trains: the comparison is not between constants
    got_norms = {r["iteration"]: r["grad_norm"] for r in read_metrics(got_cfg)}
    want_norms = {r["iteration"]: r["grad_norm"] for r in read_metrics(want_cfg)}
    for it, norm in want_norms.items():
        assert math.isclose(got_norms[it], norm, rel_tol=1e-3), f"{name} iteration {it}: grad norm {got_norms[it]}"


def _pretrain_case(cfg) -> int:
    from longspan.training.pretrain import pretrain

    pretrain(cfg)
    return 0


@pytest.mark.slow
def test_cp2_pretrain_matches_one_process(tmp_path, pool2):
    from longspan.training.pretrain import pretrain

    cp_cfg = cp_config(tmp_path, "cp2", cp=2)
    pool2.run(_pretrain_case, cp_cfg, timeout=300)
    ref_cfg = cp_config(tmp_path, "one")
    pretrain(ref_cfg)

    assert_same_run(cp_cfg, ref_cfg, "CP2")


def test_validate_accepts_cp2_and_checks_sequence_length(tmp_path):
    cfg = cp_config(tmp_path, "v", cp=2)
    cfg.model.vocab_size = 255
    cfg.validate(world_size=2)
    assert cfg.data_parallel_size == 1
    bad = cp_config(tmp_path, "v2", cp=4)
    bad.model.vocab_size = 255
    bad.model.seq_length = bad.dataset.sequence_length = 36
    with pytest.raises(ConfigError, match=r"model.seq_length=36 is not divisible by 2 x model.context_parallel_size"):
        bad.validate(world_size=4)


def test_validate_checks_hierarchical_context_parallel_like_megatron(tmp_path):
    """The a2a+p2p sub-group sizes: product equal to the cp size, read only by cp_comm_type='a2a+p2p' (which
    needs them); with valid sizes the run computes the same flat all-gather attention (a hint)."""
    cfg = cp_config(tmp_path, "h", cp=2)
    cfg.model.vocab_size = 255
    cfg.model.cp_comm_type, cfg.model.hierarchical_context_parallel_sizes = "a2a+p2p", [2, 1]
    cfg.validate(world_size=2)
    for comm, sizes, needle in [("a2a+p2p", [2, 2], "multiply to 4"), ("p2p", [2, 1], "read only by"),
                                ("a2a+p2p", None, "needs model.hierarchical_context_parallel_sizes"),
                                ("a2a+p2p", [2, 0], "positive integers")]:
        cfg.model.cp_comm_type, cfg.model.hierarchical_context_parallel_sizes = comm, sizes
        with pytest.raises(ConfigError, match=needle) as err:
            cfg.validate(world_size=2)
        assert "\n" not in str(err.value)


def test_validate_checks_cp_comm_type(tmp_path):
    cfg = cp_config(tmp_path, "c", cp=2)
    cfg.model.vocab_size = 255
    cfg.model.cp_comm_type = ["p2p", "all_gather"]
    cfg.validate(world_size=2)  # every Megatron value computes the same exact attention here
    cfg.model.cp_comm_type = "ring"
    with pytest.raises(ConfigError, match=r"model.cp_comm_type='ring' is not valid"):
        cfg.validate(world_size=2)


def test_support_table_marks_context_parallel():
    from longspan.config.support import HINT, SUPPORTED, field_status

    assert field_status("model", "context_parallel_size") == SUPPORTED
    assert field_status("model", "cp_comm_type") == HINT
    assert field_status("model", "hierarchical_context_parallel_sizes") == HINT


FOUR_RANK_LAYOUTS = {
    # dp2 x cp2: DDP over dp x cp, data split over dp only; per-token loss normalization over dp
    "dp2_cp2_per_token": dict(cp=2, per_token=True),
    # tp2 (sequence parallel) x cp2: the TP root hook, then the CP plan, FSDP2-free (dp = 1)
    "tp2_sp_cp2": dict(cp=2, tp=2, sp=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOUR_RANK_LAYOUTS))
def test_four_rank_cp_layouts_match_one_process(tmp_path, pool4, name):
    from longspan.training.pretrain import pretrain

    spec = FOUR_RANK_LAYOUTS[name]
    cfgs = []
    for label, cp in ((name, spec["cp"]), ("one", 1)):
        cfg = cp_config(tmp_path, label, cp=cp)
        cfg.model.calculate_per_token_loss = spec.get("per_token", False)
        if cp > 1:
            cfg.model.tensor_model_parallel_size = spec.get("tp", 1)
            cfg.model.sequence_parallel = spec.get("sp", False)
        cfgs.append(cfg)
    pool4.run(_pretrain_case, cfgs[0], timeout=400)
    pretrain(cfgs[1])
    assert_same_run(cfgs[0], cfgs[1], name)
