"""Pipeline parallel through the real trainer (CPU/gloo).

``longspan.training.pretrain.pretrain`` runs 8 iterations of the shrunk ``tiny`` recipe (mock data,
NullTokenizer) under PP2 (1F1B), PP2 × VP2 (interleaved) and TP2 × PP2 in harness workers; the logged
per-iteration losses (metrics.jsonl, written by the last rank) must match one process with the same global
batch within 1e-4 relative. Checkpoints saved under PP2 resume under one process and vice versa.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.layout_parity import assert_losses_match
from tests.parallel.harness import get_shared_pool
from tests.training.pretrain_helpers import losses_by_iteration

pytestmark = pytest.mark.slow

ITERS = 8
REL = 1e-4


def _config(run_dir: str, pp: int = 1, vp: int | None = None, tp: int = 1, load: str | None = None,
            ckpt_step: int | None = None):
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 4, 64, 128
    m.num_attention_heads, m.num_query_groups, m.seq_length, m.vocab_size = 4, 2, 64, None
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size = tp, pp
    m.virtual_pipeline_model_parallel_size = vp
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model, cfg.tokenizer.vocab_size = "NullTokenizer", None, 255
    cfg.dataset.data_path, cfg.dataset.sequence_length = None, 64
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters = 2, 8, ITERS
    t.eval_interval, t.eval_iters = 4, 1
    cfg.scheduler.lr_warmup_fraction, cfg.scheduler.lr_warmup_iters = None, 2
    cfg.dist.distributed_backend, cfg.dist.distributed_timeout_minutes = "gloo", 1
    cfg.checkpoint.save = f"{run_dir}/ckpt"
    cfg.checkpoint.load = load or f"{run_dir}/ckpt"
    cfg.checkpoint.ckpt_step = ckpt_step
    cfg.checkpoint.save_interval = 4
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = f"{run_dir}/tb"
    return cfg


def _pretrain(run_dir: str, **layout):
    from longspan.training.pretrain import pretrain

    state = pretrain(_config(run_dir, **layout))
    return state.train_state.step


def _losses(run_dir: Path) -> dict[int, float]:
    return losses_by_iteration(_config(str(run_dir)))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: one process, same global batch; checkpoints at iterations 4 and 8."""
    run = tmp_path_factory.mktemp("pp_ref") / "ref"
    assert _pretrain(str(run)) == ITERS
    return run


def test_pp2_1f1b_matches_one_process_and_checkpoints_move_between_layouts(one_process: Path, tmp_path: Path):
    ref = _losses(one_process)
    pool = get_shared_pool(2)
    pp_run = tmp_path / "pp2"
    assert pool.run(_pretrain, str(pp_run), pp=2, timeout=240) == [ITERS, ITERS]
    assert_losses_match(_losses(pp_run), ref, range(1, ITERS + 1), REL)
    # the checkpoint keeps the unpipelined names
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(pp_run / "ckpt" / "iter_0000004")).read_metadata().state_dict_metadata)
    assert "model.embedding.word_embeddings.weight" in keys and "model.output_layer.weight" in keys
    assert "model.decoder.layers.3.mlp.linear_fc2.weight" in keys

    # PP2's iteration-4 checkpoint resumed by one process, and the reference's by PP2
    to_one = tmp_path / "pp2_to_one"
    _pretrain(str(to_one), load=str(pp_run / "ckpt"), ckpt_step=4)
    assert_losses_match(_losses(to_one), ref, range(5, ITERS + 1), REL)
    to_pp = tmp_path / "one_to_pp2"
    pool.run(_pretrain, str(to_pp), pp=2, load=str(one_process / "ckpt"), ckpt_step=4, timeout=240)
    assert_losses_match(_losses(to_pp), ref, range(5, ITERS + 1), REL)


def test_pp2_vp2_interleaved_matches_one_process(one_process: Path, tmp_path: Path):
    run = tmp_path / "pp2vp2"
    get_shared_pool(2).run(_pretrain, str(run), pp=2, vp=2, timeout=240)
    assert_losses_match(_losses(run), _losses(one_process), range(1, ITERS + 1), REL)


def test_tp2_pp2_matches_one_process(one_process: Path, tmp_path: Path):
    run = tmp_path / "tp2pp2"
    get_shared_pool(4).run(_pretrain, str(run), pp=2, tp=2, timeout=400)
    assert_losses_match(_losses(run), _losses(one_process), range(1, ITERS + 1), REL)
