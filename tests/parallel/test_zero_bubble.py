"""Zero-bubble pipeline schedules (``model.pipeline_parallel_schedule``): torch's ZBV, DualPipeV and interleaved
zero bubble train the same model as one process; their stage placement, the planner's bubble, and the stage
and microbatch counts they cannot use.

- ``pretrain`` for 8 iterations on 2 processes (pp=2): ``ZBVZeroBubble`` and ``DualPipeV`` on 4 stages in a V
  (rank 0 holds stages 0 and 3), ``InterleavedZeroBubble`` on 4 looped stages; every iteration's loss and
  gradient norm within 1e-5 (relative) of one process's, and the evaluations (forward-only steps, which torch's
  V schedules cannot run on their own) give the one-process validation and test losses.
- The bubble the planner assumes for each schedule (formulas of ``longspan.core.pipeline_schedules``, written
  out here) and where the V shape puts the layers and the output layer.
- Bad input: one line naming the field, exit 2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from longspan.cli import main
from longspan.core.pipeline_schedules import SCHEDULES, bubble_fraction, rank_stages, stage_rank
from tests.helpers.layout_parity import logged
from tests.parallel.harness import get_shared_pool
from tests.training.pretrain_helpers import mock_layout_run

ITERS = 8
REL = 1e-5
SEQ = 32


def _config(run_dir: str, schedule: str | None = None, pp: int = 1):
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups = 4, 32, 64, 4, 2
    m.pipeline_model_parallel_size = pp
    if schedule is not None:  # every schedule here runs two stages per rank
        m.pipeline_parallel_schedule, m.virtual_pipeline_model_parallel_size = schedule, 2
    cfg = mock_layout_run(cfg, f"{run_dir}/tb", SEQ, 2, 8, ITERS)  # 4 microbatches: DualPipeV needs 2 x pp
    cfg.train.eval_interval, cfg.train.eval_iters = ITERS, 1
    return cfg


def _pretrain(run_dir: str, **layout) -> int:
    from longspan.training.pretrain import pretrain

    return pretrain(_config(run_dir, **layout)).train_state.step


def _pretrain_recording(run_dir: str, **layout) -> tuple[int, list[tuple[str, bool, list[int]]]]:
    """``_pretrain`` on a worker, and each pipeline runtime it built: (torch schedule class, forward only,
    this rank's stages)."""
    from longspan.training.step import pipeline_schedules

    built = []
    original = pipeline_schedules._PipelineRuntime.__init__

    def record(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        built.append((type(self.schedule).__name__, self.forward_only, [s.stage_index for s in self.stages]))

    pipeline_schedules._PipelineRuntime.__init__ = record
    try:
        return _pretrain(run_dir, **layout), built
    finally:
        pipeline_schedules._PipelineRuntime.__init__ = original


def _validation_losses(tb_dir: str) -> list[float]:
    rows = [json.loads(line) for line in open(os.path.join(tb_dir, "metrics.jsonl"))]
    return [r["losses"]["lm loss"] for r in rows if r.get("phase") == "validation"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = str(tmp_path_factory.mktemp("one_process"))
    assert _pretrain(run_dir) == ITERS
    out = logged(os.path.join(run_dir, "tb"))
    out["valid"] = _validation_losses(os.path.join(run_dir, "tb"))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"])
def test_schedule_trains_as_one_process(schedule: str, one_process: dict, tmp_path: Path) -> None:
    want = one_process
    assert want["losses"][-1] < want["losses"][0] * 0.95  # the reference trained
    assert len(want["valid"]) == 2  # the validation set at iteration 8, then the test set
    ranks = get_shared_pool(2).run(_pretrain_recording, str(tmp_path), timeout=240, schedule=schedule, pp=2)
    stages = [[0, 3], [1, 2]] if schedule in ("ZBVZeroBubble", "DualPipeV") else [[0, 2], [1, 3]]
    for rank, (steps, built) in enumerate(ranks):  # training, then evaluation, on the schedule's stages
        assert steps == ITERS
        assert built == [(f"Schedule{schedule}", False, stages[rank]), (f"Schedule{schedule}", True, stages[rank])]
    got = logged(os.path.join(str(tmp_path), "tb"))
    assert got["iterations"] == want["iterations"] == list(range(1, ITERS + 1))
    for key in ("losses", "norms"):
        for i, (g, w) in enumerate(zip(got[key], want[key], strict=True)):
            assert abs(g - w) <= REL * abs(w), f"{schedule} {key}[{i}]: {g} vs one process {w}"
    for g, w in zip(_validation_losses(os.path.join(str(tmp_path), "tb")), want["valid"], strict=True):
        assert abs(g - w) <= REL * abs(w), f"{schedule} validation loss {g} vs one process {w}"


# ------------------------------------------------------------------------------------ placement, bubble


def test_v_shape_puts_both_ends_on_rank_0() -> None:
    assert [rank_stages(r, 4, 8, v_shape=True) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [rank_stages(r, 4, 8, v_shape=False) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_rank(s, 4, v_shape=True) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_bubble_fractions() -> None:
    """Idle over useful time with F = W = input gradient (full backward B = 2F), p ranks, m microbatches:
    1F1B (p-1)(F+B) / (m(F+B)); ZB1P (p-1)(F+B-2W) (DeepSeek-V3 Table 2), divided by v when interleaved;
    DualPipeV (p-1)(F&B+B-3W) with F&B = F+B; ZB-V zero from 2p-1 microbatches, torch's padded slots below."""
    p, m = 4, 8
    assert bubble_fraction(SCHEDULES["1F1B"], p, m) == pytest.approx(3 / 8)
    assert bubble_fraction(SCHEDULES["Interleaved1F1B"], p, m, 2) == pytest.approx(3 / 16)
    assert bubble_fraction(SCHEDULES["InterleavedZeroBubble"], p, m, 2) == pytest.approx(3 * 1 / (8 * 3) / 2)
    assert bubble_fraction(SCHEDULES["DualPipeV"], p, m, 2) == pytest.approx(3 * (3 + 2 - 3) / (8 * 6))
    assert bubble_fraction(SCHEDULES["ZBVZeroBubble"], p, m, 2) == 0.0
    assert bubble_fraction(SCHEDULES["ZBVZeroBubble"], p, 4, 2) == pytest.approx(3 / 4)


def test_planner_times_and_places_each_schedule() -> None:
    """The step time stretches by the schedule's bubble; under a V the output layer sits on rank 0."""
    from longspan.parallel.mesh import derive_layout
    from longspan.planner.plan import estimate_step_time, rank_parameter_counts
    from longspan.recipes import get_recipe

    def planned(schedule: str | None, vp: int | None) -> tuple[float, list[dict]]:
        cfg = get_recipe("tiny")
        cfg.model.pipeline_model_parallel_size, cfg.model.virtual_pipeline_model_parallel_size = 2, vp
        cfg.model.pipeline_parallel_schedule = schedule
        cfg.validate(world_size=2)
        layout = derive_layout(2, tp=1, cp=1, pp=2, ep=1, etp=1)
        meta = cfg.model.provide_meta()
        return estimate_step_time(cfg, layout, "h100", meta), rank_parameter_counts(cfg, layout, meta)

    base, loop = planned(None, None)  # 8 microbatches on 2 ranks: 1F1B's bubble is 1/8
    zbv, v = planned("ZBVZeroBubble", 2)
    dual, _ = planned("DualPipeV", 2)
    izb, _ = planned("InterleavedZeroBubble", 2)
    compute = base / (1 + 1 / 8)  # one rank, so no communication term
    assert zbv == pytest.approx(compute)
    assert dual == pytest.approx(compute * (1 + 1 / 24))
    assert izb == pytest.approx(compute * (1 + 1 / 48))
    # the output layer (and final norm) moves from rank 1 to rank 0; the layers split 2 and 2 either way
    assert v[0]["dense"] - loop[0]["dense"] == loop[1]["root"] == pytest.approx(v[0]["root"] - loop[0]["root"])


# ------------------------------------------------------------------------------------------ bad input

BAD = [
    (["--world-size", "2", "model.pipeline_model_parallel_size=2", "model.pipeline_parallel_schedule=ZBVZeroBubble"],
     "set model.virtual_pipeline_model_parallel_size=2 (it is None)"),
    (["--world-size", "2", "model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
      "model.pipeline_parallel_schedule=DualPipeV", "train.global_batch_size=4"],
     "2 microbatches (train.global_batch_size=4"),
    (["--world-size", "2", "model.pipeline_model_parallel_size=2", "model.pipeline_parallel_schedule=ZBV"],
     "model.pipeline_parallel_schedule='ZBV' is not a pipeline schedule"),
    (["--world-size", "1", "model.pipeline_parallel_schedule=InterleavedZeroBubble"],
     "needs model.pipeline_model_parallel_size > 1"),
    (["--world-size", "4", "model.pipeline_model_parallel_size=2",
      "model.pipeline_parallel_schedule=InterleavedZeroBubble"],
     "not supported yet with data-parallel x context-parallel size 2"),
    (["--world-size", "2", "model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
      "model.pipeline_parallel_schedule=1F1B"], "runs one stage per pipeline rank"),
    (["--world-size", "2", "model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
      "model.pipeline_parallel_schedule=ZBVZeroBubble", "model.share_embeddings_and_output_weights=true"],
     "with tied embeddings or multi-token prediction"),
]


@pytest.mark.parametrize("argv,fragment", BAD, ids=[a[-1] for a, _ in BAD])
def test_bad_schedule_is_one_line_exit_2(argv: list[str], fragment: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "validate", "--recipe", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.pipeline_parallel_schedule" in err[0] and fragment in err[0], err
