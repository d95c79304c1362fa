"""Multi-token prediction under parallel layouts: 8 ``pretrain`` iterations of the shrunk tiny recipe with two
MTP depths log the same ``lm loss`` and ``mtp_k loss`` values (metrics.jsonl) under TP2, DP2 (DDP), DP2 FSDP2 and PP2 (depths on the last stage) as one process,
within the fp32 CPU layout bound (1e-5 relative)."""

from __future__ import annotations

import pytest

from tests.parallel.harness import get_shared_pool
from tests.parallel.test_layout_parity import REL_TOL, _max_rel, pretrain_config

pytestmark = pytest.mark.slow

DEPTHS = 2
NAMES = ["lm loss"] + [f"mtp_{k} loss" for k in range(1, DEPTHS + 1)]


def run_mtp_pretrain(run_dir: str, tp: int = 1, fsdp2: bool = False, pp: int = 1, vp: int | None = None,
                     tied: bool = True) -> None:
    """Worker task: ``pretrain`` with MTP depths (a large loss weight, so the MTP gradient shows)."""
    from longspan.training.pretrain import pretrain

    cfg = pretrain_config(run_dir, tp=tp, fsdp2=fsdp2)
    cfg.train.global_batch_size = 8  # four microbatches per iteration on one process or TP2, two per DP rank
    cfg.model.mtp_num_layers = DEPTHS
    cfg.model.mtp_loss_scaling_factor = 0.5
    cfg.model.share_embeddings_and_output_weights = tied
    cfg.model.pipeline_model_parallel_size = pp
    cfg.model.virtual_pipeline_model_parallel_size = vp
    pretrain(cfg)


def logged_losses(run_dir: str) -> dict[str, list[float]]:
    import json
    import os

    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in rows if r.get("phase") == "train"]
    return {name: [r["losses"][name] for r in rows] for name in NAMES}


@pytest.fixture(scope="module")
def mtp_reference(tmp_path_factory):
    """One-process runs, tied and untied embeddings, each once per module."""
    cache: dict[bool, dict[str, list[float]]] = {}

    def reference(tied: bool) -> dict[str, list[float]]:
        if tied not in cache:
            run_dir = str(tmp_path_factory.mktemp("mtp_reference"))
            run_mtp_pretrain(run_dir, tied=tied)
            cache[tied] = logged_losses(run_dir)
        return cache[tied]

    return reference


@pytest.mark.parametrize("name,overrides", [
    ("tp2", dict(tp=2)), ("dp2", dict()), ("dp2_fsdp2", dict(fsdp2=True)),
    # the depths on the last stage, with their copy of the (untied) embedding
    ("pp2", dict(pp=2, tied=False)),
    ("pp2_vp2", dict(pp=2, vp=2, tied=False)),  # the last virtual stage (rank 1's second chunk)
])
def test_mtp_layout_matches_one_process(name, overrides, mtp_reference, tmp_path):
    get_shared_pool(2).run(run_mtp_pretrain, str(tmp_path), timeout=300, **overrides)
    got = logged_losses(str(tmp_path))
    reference = mtp_reference(overrides.get("tied", True))
    for loss in NAMES:
        want = reference[loss]
        assert len(want) == 8 and want[-1] < want[0]
        print(f"{name} {loss}: max rel {_max_rel(got[loss], want):.1e} over {len(want)} iterations")  # with -rP
        assert len(got[loss]) == 8 and _max_rel(got[loss], want) <= REL_TOL, (
            f"{name} {loss}: {got[loss]} vs one process {want} (max rel {_max_rel(got[loss], want):.1e})")


def mtp_checkpointed_pretrain(run_dir: str, **layout) -> int:
    """Worker task: the pipeline tests' checkpointing config (saves at iterations 4 and 8) with MTP depths."""
    from longspan.training.pretrain import pretrain
    from tests.parallel.test_pipeline_pretrain import _config

    cfg = _config(run_dir, **layout)
    cfg.model.mtp_num_layers = DEPTHS
    cfg.model.mtp_loss_scaling_factor = 0.5
    return pretrain(cfg).train_state.step


def test_mtp_checkpoints_move_between_one_process_and_pp2(tmp_path):
    import torch.distributed.checkpoint as dcp

    from tests.parallel.test_pipeline_pretrain import _config
    from tests.training.pretrain_helpers import read_metrics

    def losses(run_dir) -> dict[int, dict[str, float]]:
        return {r["iteration"]: {n: r["losses"][n] for n in NAMES} for r in read_metrics(_config(str(run_dir)))}

    def close(got, want, iterations) -> None:
        assert sorted(got) == list(iterations)
        for it in iterations:
            for name in NAMES:
                assert _max_rel([got[it][name]], [want[it][name]]) <= REL_TOL, (it, name, got[it], want[it])

    one, pp = tmp_path / "one", tmp_path / "pp2"
    assert mtp_checkpointed_pretrain(str(one)) == 8
    pool = get_shared_pool(2)
    assert pool.run(mtp_checkpointed_pretrain, str(pp), pp=2, timeout=300) == [8, 8]
    ref = losses(one)
    close(losses(pp), ref, range(1, 9))
    keys = set(dcp.FileSystemReader(str(pp / "ckpt" / "iter_0000004")).read_metadata().state_dict_metadata)
    assert {"model.embedding.word_embeddings.weight", "model.mtp.layers.1.eh_proj.weight",
            "model.mtp.layers.0.transformer_layer.mlp.linear_fc2.weight"} <= keys
    to_one, to_pp = tmp_path / "pp2_to_one", tmp_path / "one_to_pp2"
    mtp_checkpointed_pretrain(str(to_one), load=str(pp / "ckpt"), ckpt_step=4)
    close(losses(to_one), ref, range(5, 9))
    pool.run(mtp_checkpointed_pretrain, str(to_pp), pp=2, load=str(one / "ckpt"), ckpt_step=4, timeout=300)
    close(losses(to_pp), ref, range(5, 9))
