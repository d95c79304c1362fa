"""tiny-mamba and tiny-hybrid through pretrain() under DP2 (DDP), FSDP2, PP2, TP2 and (the hybrid) DP2×TP2 match
one process.

Each layout runs 8 iterations of the shrunk recipe (mock data, hidden 32, sequence 48 over chunks of 16)
in the shared worker pools; the logged per-iteration losses and gradient norms must equal the one-process
run's within 1e-5 relative. The pipeline cut falls in the middle of the pattern (``MM|MM``, ``M*|M-``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.models.mamba.mamba_test_config import small_mamba_run
from tests.helpers.layout_parity import logged
from tests.parallel.harness import get_shared_pool

pytestmark = pytest.mark.slow

ITERS = 8
REL = 1e-5


def _config(run_dir: str, recipe: str, dp_mode: str = "ddp", pp: int = 1, tp: int = 1, save: str | None = None,
            load: str | None = None, exit_interval: int | None = None):
    cfg = small_mamba_run(run_dir, recipe, "run", train_iters=ITERS, eval_interval=None, eval_iters=0,
                          exit_interval=exit_interval)
    cfg.checkpoint.save, cfg.checkpoint.load = save, load
    cfg.dist.distributed_backend, cfg.dist.distributed_timeout_minutes = "gloo", 1
    cfg.dist.use_torch_fsdp2 = dp_mode == "fsdp2"
    cfg.model.pipeline_model_parallel_size = pp
    cfg.model.tensor_model_parallel_size = tp
    return cfg


def _run(run_dir: str, recipe: str, **layout) -> tuple[str, list]:
    """Worker task: pretrain; returns the class of the trained model (one-stage layouts) and the layers of
    each model this rank built."""
    import longspan.parallel.parallelize as parallelize_mod
    import longspan.parallel.pipeline as pipeline_mod
    import longspan.training.setup as setup_mod
    from longspan.training.pretrain import pretrain

    seen: dict = {"layers": []}
    original = parallelize_mod.parallelize_model
    original_build = setup_mod.build_meta_model

    def build_spy(*args, **kwargs):
        model = original_build(*args, **kwargs)
        seen["layers"].append(list(model.decoder.layers))
        return model

    setup_mod.build_meta_model = pipeline_mod.build_meta_model = build_spy  # one model, or each pipeline chunk

    def spy(model, cfg, parallel):
        wrapped = original(model, cfg, parallel)
        seen["wrapper"] = type(wrapped).__name__
        return wrapped

    parallelize_mod.parallelize_model = spy
    try:
        pretrain(_config(run_dir, recipe, **layout))
    finally:
        parallelize_mod.parallelize_model = original
        setup_mod.build_meta_model = pipeline_mod.build_meta_model = original_build
    return seen.get("wrapper", ""), seen["layers"]


def _logged(run_dir: str) -> dict:
    return logged(os.path.join(run_dir, "run", "tb"))


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    out = {}
    for recipe in ("tiny-mamba", "tiny-hybrid"):
        run_dir = str(tmp_path_factory.mktemp(recipe))
        _run(run_dir, recipe)
        out[recipe] = _logged(run_dir)
    return out


LAYOUTS = {  # name: (world size, overrides, model class after parallelize_model)
    "dp2_ddp": (2, dict(), "DistributedDataParallel"),
    "dp2_fsdp2": (2, dict(dp_mode="fsdp2"), "FSDPMambaModel"),
    "pp2": (2, dict(pp=2), "MambaModel"),
    "tp2": (2, dict(tp=2), "MambaModel"),
    # DDP takes no DTensor parameters: FSDP2 (reshard_after_forward=False) carries dp, as for GPT
    "dp2_tp2": (4, dict(tp=2), "FSDPMambaModel"),
}


# the 4-rank layout once, on the hybrid (its Mamba layers are the pure model's, beside attention and MLP layers)
CASES = [(name, recipe) for recipe in ("tiny-mamba", "tiny-hybrid") for name in LAYOUTS
         if not (name == "dp2_tp2" and recipe == "tiny-mamba")]


@pytest.mark.parametrize("name,recipe", CASES, ids=[f"{name}-{recipe}" for name, recipe in CASES])
def test_layout_matches_one_process(name: str, recipe: str, references: dict, tmp_path: Path) -> None:
    world, overrides, wrapper = LAYOUTS[name]
    results = get_shared_pool(world).run(_run, str(tmp_path), recipe, timeout=300, **overrides)
    assert [w for w, _ in results] == [wrapper] * world
    if name == "pp2":  # the cut falls inside the pattern
        assert [layers for _, layers in results] == [[["0", "1"]], [["2", "3"]]]
    got, want = _logged(str(tmp_path)), references[recipe]
    assert got["iterations"] == list(range(1, ITERS + 1)) == want["iterations"]
    for key in ("losses", "norms"):
        for i, (g, w) in enumerate(zip(got[key], want[key])):
            assert abs(g - w) <= REL * abs(w), f"{name} {recipe} {key}[{i}]: {g} vs {w}"
    assert want["losses"][-1] < want["losses"][0]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)])
def test_checkpoint_moves_from_a_layout_to_one_process(layout: dict, references: dict, tmp_path: Path) -> None:
    """tiny-hybrid stops at iteration 4 under TP2 / PP2; one process resumes the checkpoint and logs the
    reference's iterations 5-8 (the mixers' head-sharded DTensors reshard)."""
    ckpt = str(tmp_path / "ckpt")
    get_shared_pool(2).run(_run, str(tmp_path / "two"), "tiny-hybrid", save=ckpt, exit_interval=4, timeout=300,
                           **layout)
    _run(str(tmp_path / "one"), "tiny-hybrid", load=ckpt)
    got, want = _logged(str(tmp_path / "one")), references["tiny-hybrid"]
    assert got["iterations"] == [5, 6, 7, 8]
    for g, w in zip(got["losses"], want["losses"][4:]):
        assert abs(g - w) <= REL * abs(w), (g, w)
