"""tiny-t5 through pretrain() under DP2 (DDP), DP2 FSDP2, TP2 + SP, CP2 and PP2 x TP2 matches one process.

Each layout runs 8 iterations of the shrunk recipe (byte corpus, hidden 32, encoder 64 / decoder 32 tokens)
in the shared 2-worker pool; the logged per-iteration losses and gradient norms must equal the one-process
run's within 1e-5 relative; PP2 x TP2 (four ranks) with two virtual stages per rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.models.t5.t5_test_config import small_t5_run, write_byte_corpus
from tests.helpers.layout_parity import logged
from tests.parallel.harness import get_shared_pool

pytestmark = pytest.mark.slow

ITERS = 8
REL = 1e-5


def _config(run_dir: str, data_dir: str, dp_mode: str = "ddp", tp: int = 1, pp: int = 1, sp: bool = False,
            cp: int = 1, vp: int | None = None):
    cfg = small_t5_run(run_dir, "run", data_dir=data_dir, train_iters=ITERS, eval_interval=None, eval_iters=0)
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.dist.distributed_backend, cfg.dist.distributed_timeout_minutes = "gloo", 1
    cfg.dist.use_torch_fsdp2 = dp_mode == "fsdp2"
    cfg.model.tensor_model_parallel_size = tp
    cfg.model.pipeline_model_parallel_size = pp
    # per-head QK norms (replicated weights on head-sharded inputs under TP) and residuals taken after the
    # norms (local sequence shards under SP) ride along in every layout
    cfg.model.qk_layernorm = True
    cfg.model.apply_residual_connection_post_layernorm = True
    cfg.model.sequence_parallel = sp
    cfg.model.context_parallel_size = cp
    cfg.model.virtual_pipeline_model_parallel_size = vp
    return cfg


def _run(run_dir: str, data_dir: str, **layout) -> tuple[str, dict]:
    """Worker task: pretrain; returns the trained model's class after the parallel plans and the local shape
    of a few parameters on this rank."""
    import longspan.parallel.parallelize as parallelize_mod
    from longspan.training.pretrain import pretrain

    seen: dict = {}
    original = parallelize_mod.parallelize_model

    def spy(model, cfg, parallel):
        wrapped = original(model, cfg, parallel)
        seen["wrapper"] = type(wrapped).__name__
        inner = getattr(wrapped, "module", wrapped)
        # the layers of each model chunk this rank holds (pipeline stages): encoder and decoder keys
        seen.setdefault("layers", []).append((list(inner.encoder.layers), list(inner.decoder.layers)))
        if cfg.model.pipeline_model_parallel_size > 1:
            return wrapped
        shapes = {}
        for name in ("decoder.layers.0.cross_attention.linear_k.weight",
                     "encoder_relative_pos_emb.relative_attention_bias.weight"):
            p = inner.get_parameter(name)
            shapes[name] = list(p.to_local().shape if hasattr(p, "to_local") else p.shape)
        # what proves sequence and context parallel act: sharded norms, the gathering attention core
        shapes["sequence_parallel_norm"] = hasattr(inner.encoder.final_layernorm.weight, "to_local")
        shapes["attention_core"] = type(inner.decoder.layers["0"].cross_attention.core_attention).__name__
        seen["shapes"] = shapes
        return wrapped

    parallelize_mod.parallelize_model = spy
    try:
        pretrain(_config(run_dir, data_dir, **layout))
    finally:
        parallelize_mod.parallelize_model = original
    return seen.get("wrapper", ""), seen.get("shapes", {}), seen["layers"]


def _logged(run_dir: str) -> dict:
    return logged(os.path.join(run_dir, "run", "tb"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("t5data")
    write_byte_corpus(directory)
    return str(directory)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir) -> dict:
    run_dir = str(tmp_path_factory.mktemp("t5ref"))
    _run(run_dir, data_dir)
    return _logged(run_dir)


LAYOUTS = {  # name: (overrides, model class after parallelize_model, local [k rows, bias heads])
    "dp2_ddp": (dict(), "DistributedDataParallel", (32, 4)),
    "dp2_fsdp2": (dict(dp_mode="fsdp2"), "FSDPT5Model", None),
    # plain TP (no sequence parallel): pp2_vp2_tp2
    "tp2_sp": (dict(tp=2, sp=True), "T5Model", (16, 2)),
    "cp2": (dict(cp=2), "DistributedDataParallel", (32, 4)),
    # four ranks, a tp pair per pipeline rank, two virtual stages each: both stacks' relative tables are used
    # on both ranks and held twice per rank (their gradients summed over all four copies). Stages holding both
    # stacks' layers and encoder_pipeline_model_parallel_size's split: test_t5_model.py (chained stages).
    "pp2_vp2_tp2": (dict(pp=2, tp=2, vp=2), "T5Model", None),
}
STAGE_LAYERS = {  # per rank (tp pairs on each pipeline rank), per model chunk: (encoder, decoder) layers
    # virtual stages 0-3 hold one layer each: encoder 0, encoder 1, decoder 0, decoder 1 (stage s on rank s % 2)
    "pp2_vp2_tp2": [[(["0"], []), ([], ["0"])]] * 2 + [[(["1"], []), ([], ["1"])]] * 2,
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(name: str, reference: dict, data_dir: str, tmp_path: Path) -> None:
    overrides, wrapper, local = LAYOUTS[name]
    world = 4 if overrides.get("pp", 1) * overrides.get("tp", 1) == 4 else 2
    results = get_shared_pool(world).run(_run, str(tmp_path), data_dir, timeout=300, **overrides)
    assert [w for w, _, _ in results] == [wrapper] * world
    assert [layers for _, _, layers in results] == STAGE_LAYERS.get(name, [[(["0", "1"], ["0", "1"])]] * 2)
    for _, shapes, _ in results:
        if not shapes:  # pipeline stages
            continue
        if name != "dp2_fsdp2":
            assert shapes["sequence_parallel_norm"] == overrides.get("sp", False)
        want_core = "T5ContextParallelAttention" if overrides.get("cp", 1) > 1 else "function"
        assert shapes["attention_core"] == want_core
    if local is not None:  # TP2: each rank holds half the heads of the cross-attention and of the bias table
        for _, shapes, _ in results:
            assert shapes["decoder.layers.0.cross_attention.linear_k.weight"][0] == local[0]
            assert shapes["encoder_relative_pos_emb.relative_attention_bias.weight"][1] == local[1]
    got, want = _logged(str(tmp_path)), reference
    assert got["iterations"] == list(range(1, ITERS + 1)) == want["iterations"]
    for key in ("losses", "norms"):
        for i, (g, w) in enumerate(zip(got[key], want[key])):
            assert abs(g - w) <= REL * abs(w), f"{name} {key}[{i}]: {g} vs {w}"
    assert want["losses"][-1] < want["losses"][0]
