"""PEFT under TP2, TP2 with sequence parallel, PP2, CP2, DP2 (DDP), DP2 (FSDP2) and EP2 (MoE) (DoRA and
CanonicalLoRA where their parameters are sharded), and on 4 ranks
TP2+SP with DP2 / PP2 / CP2, through ``finetune()``: the logged losses and gradient norms match one process
(fp32 CPU, rel 1e-5)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.parallel.harness import get_shared_pool

pytestmark = pytest.mark.slow

ITERS = 5
REL = 1e-5


def _config(run_dir: str, base: str | None, peft_kind: str = "lora", tp: int = 1, sp: bool = False, pp: int = 1,
            fsdp2: bool = False, iters: int = ITERS, ep: int = 1, moe: bool = False, cp: int = 1):
    from longspan.peft import CanonicalLoRA, DoRA, LoRA
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 4, 64, 128
    m.num_attention_heads, m.num_query_groups, m.seq_length, m.vocab_size = 4, 2, 64, None
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.sequence_parallel = tp, pp, sp
    m.context_parallel_size = cp
    m.hidden_dropout = m.attention_dropout = 0.0
    if moe:  # 4 routed experts on every layer, sharded over ep ranks
        m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 4, 2, 32
        m.moe_aux_loss_coeff = 1e-2
        m.expert_model_parallel_size = ep
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model, cfg.tokenizer.vocab_size = "NullTokenizer", None, 255
    cfg.dataset.data_path, cfg.dataset.sequence_length = None, 64
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters = 2, 8, iters
    t.eval_interval, t.eval_iters = None, 0
    cfg.scheduler.lr_warmup_fraction, cfg.scheduler.lr_warmup_iters = None, 1
    cfg.optimizer.lr = 1e-2
    cfg.dist.distributed_backend, cfg.dist.distributed_timeout_minutes = "gloo", 1
    cfg.dist.use_torch_fsdp2 = fsdp2
    cfg.checkpoint.save = f"{run_dir}/ckpt" if base is None else None
    cfg.checkpoint.save_interval = iters if base is None else None
    cfg.checkpoint.load = None
    cfg.checkpoint.pretrained_checkpoint = base
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = f"{run_dir}/tb"
    if base is not None and peft_kind != "none":
        cfg.peft = {"lora": LoRA(dim=4, alpha=8), "dora": DoRA(dim=4, alpha=8),
                    "canonical": CanonicalLoRA(dim=4, alpha=8)}[peft_kind]
    return cfg


def _finetune(run_dir: str, base: str, **layout) -> int:
    from longspan.training.finetune import finetune

    cfg = _config(run_dir, base, **layout)
    state = finetune(cfg)
    return state.train_state.step


def _logged(run_dir: Path) -> tuple[list[float], list[float]]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "tb", "metrics.jsonl"))]
    rows = [r for r in rows if r.get("phase", "train") == "train"]
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    return [r["losses"]["lm loss"] for r in rows], [r["grad_norm"] for r in rows]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    from longspan.training.pretrain import pretrain

    run = str(tmp_path_factory.mktemp("peft_layout_base"))
    pretrain(_config(run, None, iters=2))
    return f"{run}/ckpt"


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory: pytest.TempPathFactory) -> str:
    from longspan.training.pretrain import pretrain

    run = str(tmp_path_factory.mktemp("peft_moe_base"))
    pretrain(_config(run, None, iters=2, moe=True))
    return f"{run}/ckpt"


@pytest.mark.parametrize("kind", ["lora", "canonical"])
def test_moe_expert_parallel_matches_one_process(kind: str, moe_base: str, tmp_path: Path) -> None:
    """Per-expert adapters shard with their experts over ep=2 (gradients reduced with the experts')."""
    ref = tmp_path / "ref"
    assert _finetune(str(ref), moe_base, peft_kind=kind, moe=True) == ITERS
    ep2 = tmp_path / "ep2"
    steps = get_shared_pool(2).run(_finetune, str(ep2), moe_base, peft_kind=kind, moe=True, ep=2, timeout=300)
    assert steps == [ITERS, ITERS]
    (losses, norms), (ref_losses, ref_norms) = _logged(ep2), _logged(ref)
    assert losses == pytest.approx(ref_losses, rel=REL)
    assert norms == pytest.approx(ref_norms, rel=REL)


@pytest.fixture(scope="module")
def references(base: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = {}
    for kind in ("lora", "dora", "canonical"):
        run = tmp_path_factory.mktemp(f"ref_{kind}")
        assert _finetune(str(run), base, peft_kind=kind) == ITERS
        out[kind] = _logged(run)
    return out


LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2),
    "dp2_ddp": dict(),
    "dp2_fsdp2": dict(fsdp2=True),
}


# LoRA in every layout; DoRA (its magnitude vector and weight norms) and CanonicalLoRA (separate q/k/v and
# gate/up adapters) where their parameters are sharded: TP2+SP (row/column splits, the norms over a split weight)
# and FSDP2 (every adapter parameter a shard). Replicated layouts treat their adapters as LoRA's, and the 4-rank
# cases add DoRA under TP2+SP+DP2 and CanonicalLoRA under TP2+SP+PP2.
KIND_LAYOUTS = [(layout, "lora") for layout in LAYOUTS] + [
    (layout, kind) for kind in ("dora", "canonical") for layout in ("tp2_sp", "dp2_fsdp2")]


@pytest.mark.parametrize("layout,kind", KIND_LAYOUTS, ids=[f"{layout}-{kind}" for layout, kind in KIND_LAYOUTS])
def test_layout_matches_one_process(layout: str, kind: str, base: str, references: dict, tmp_path: Path) -> None:
    steps = get_shared_pool(2).run(_finetune, str(tmp_path), base, peft_kind=kind, timeout=300, **LAYOUTS[layout])
    assert steps == [ITERS, ITERS]
    losses, norms = _logged(tmp_path)
    ref_losses, ref_norms = references[kind]
    assert losses == pytest.approx(ref_losses, rel=REL)
    assert norms == pytest.approx(ref_norms, rel=REL)



#: 4-rank layouts, each with one adapter kind (all 9 pairs passed when written; 3 keep the suite short)
LAYOUTS_4 = {
    "tp2_sp_dp2": ("dora", dict(tp=2, sp=True)),
    "tp2_sp_pp2": ("canonical", dict(tp=2, sp=True, pp=2)),
    "tp2_sp_cp2": ("lora", dict(tp=2, sp=True, cp=2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS_4))
def test_four_rank_layout_matches_one_process(layout: str, base: str, references: dict, tmp_path: Path) -> None:
    """Sequence parallel combined with data, pipeline and context parallel on 4 ranks."""
    kind, fields = LAYOUTS_4[layout]
    steps = get_shared_pool(4).run(_finetune, str(tmp_path), base, peft_kind=kind, timeout=400, **fields)
    assert steps == [ITERS] * 4
    losses, norms = _logged(tmp_path)
    ref_losses, ref_norms = references[kind]
    assert losses == pytest.approx(ref_losses, rel=REL)
    assert norms == pytest.approx(ref_norms, rel=REL)
