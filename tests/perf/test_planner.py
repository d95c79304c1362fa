"""``longspan plan``: layouts enumerated and validated, per-rank parameter accounting, the table and its exit
codes, and the memory estimate against measured peaks of real CPU runs (fresh processes) within 25%."""

from __future__ import annotations

import os
import sys

import pytest

from longspan.cli import main
from longspan.core.errors import ConfigError
from longspan.parallel.mesh import check_layout, derive_layout
from longspan.planner import plan as planner

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_plan_memory as bench  # noqa: E402


# The measured peak RSS of one fresh process moves with the allocator, the libraries' own allocations and the
# machine. Cases whose model and activations dominate the process are compared: measured on a loaded 2-core
# machine, one +1.2% (775 MiB estimated, 765 measured), one-fused-loss -1.7%, dp2-small-fsdp2 -0.2..-14%
# (largest rank, one run each). The smallest single-process cases are left out: their peak is mostly the
# runtime's own memory (one-small measured 205-245 MiB against 267, +9..+30%, depending on which imports
# happened before the measurement started). 25% leaves a margin of ten points over the compared spread.
PEAK_REL_TOL = 0.25


def _cfg(name="one-small"):
    cfg = bench.case_config(name)
    cfg.model.vocab_size = cfg.tokenizer.vocab_size + 1
    cfg.model.finalize()
    return cfg


def test_parse_size():
    assert planner.parse_size("80GiB") == 80 * 2**30
    assert planner.parse_size("80GB") == 80e9
    assert planner.parse_size("1.5 MiB") == 1.5 * 2**20
    assert planner.parse_size("4096") == 4096
    with pytest.raises(ConfigError, match="--memory-per-device='lots'"):
        planner.parse_size("lots")


def test_parameter_counts_per_rank_add_up():
    from longspan.models.gpt import build_gpt_model, num_parameters

    cfg = _cfg()
    meta = build_gpt_model(cfg.model, materialize=False)
    total = num_parameters(meta)
    one = planner.rank_parameter_counts(cfg, derive_layout(1), meta)
    assert one[0]["dense"] == total and one[0]["expert"] == 0
    pp2 = planner.rank_parameter_counts(cfg, derive_layout(2, pp=2), meta)
    assert pp2[0]["dense"] + pp2[1]["dense"] == total  # untied: every parameter on exactly one stage
    emb = meta.embedding.word_embeddings.weight.numel()
    assert pp2[0]["dense"] > emb and pp2[1]["dense"] > emb  # embedding first, output layer last
    tp2 = planner.rank_parameter_counts(cfg, derive_layout(2, tp=2), meta)
    norms = sum(p.numel() for n, p in meta.named_parameters() if "layernorm" in n)
    assert tp2[0]["dense"] == pytest.approx((total - norms) / 2 + norms)


def test_candidate_layouts_are_valid_and_complete():
    cfg = _cfg()
    candidates, rejected = planner.candidate_layouts(cfg, 4)
    seen = {(l.tp, l.pp, l.cp) for _, l in candidates}
    # heads 4, layers 2, seq 128, global batch 8 of microbatches of 4: dp must divide 2
    assert seen == {(1, 1, 2), (1, 1, 4), (1, 2, 2), (2, 1, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)}
    assert any(r.startswith("tp=1 pp=1 cp=1 ep=1: train.global_batch_size=8 is not divisible") for r in rejected)
    assert any(r.startswith("tp=1 pp=2 cp=1 ep=1: 1 microbatches") for r in rejected)
    assert all(l.pp <= 2 for _, l in candidates)
    for lcfg, layout in candidates:
        check_layout(4, lcfg.model)
        assert layout.tp * layout.pp * layout.cp * layout.dp == 4


def test_plan_cli_table_best_first(capsys):
    assert main(["plan", "--recipe", "tiny", "--world-size", "4", "--device", "cpu", "--memory-per-device", "8GiB"]) == 0
    out = capsys.readouterr().out.splitlines()
    from longspan.models.gpt import num_parameters
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    total = num_parameters(cfg.model.provide_meta())
    assert out[0].startswith(f"model: {total:,} parameters ({total:,} active per token); ")
    assert out[1].split()[:5] == ["tp", "pp", "cp", "dp", "ep"]
    assert out[2].split() == ["(per", "rank)"] + ["GiB"] * 6 + ["seconds", "tokens/s"]
    rows = [line.split() for line in out[4:]]
    assert len(rows) >= 6 and all(r[-3] == "yes" for r in rows)
    times = [float(r[-2]) for r in rows]
    assert times == sorted(times)


def test_plan_cli_nothing_fits_exits_2(capsys):
    assert main(["plan", "--recipe", "tiny", "--world-size", "2", "--device", "h100",
                 "--memory-per-device", "1MiB"]) == 2
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("longspan plan: no layout fits: the smallest per-rank need is ")
    assert "against --memory-per-device 0.00 GiB" in last


def test_plan_cli_bad_arguments_exit_2(capsys):
    assert main(["plan", "--recipe", "tiny", "--world-size", "2", "--memory-per-device", "lots"]) == 2
    assert main(["plan", "--recipe", "tiny", "--world-size", "2", "--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert "--memory-per-device='lots'" in err and "--device='tpu'" in err


@pytest.mark.slow
@pytest.mark.parametrize("case", ["one", "one-fused-loss", "dp2-small-fsdp2"])
def test_estimate_is_close_to_the_measured_peak(case):
    estimate, measured = bench.estimate(case), bench.measure(case)
    assert abs(estimate - measured) <= PEAK_REL_TOL * measured, (case, estimate / 2**20, measured / 2**20)
