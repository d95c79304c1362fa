"""Expert parallel parity: ``tiny-moe`` under EP2 and EP2 × TP2 trains the same model as one process.

Model + optimizer level: the model is built as the trainer builds it (meta model -> ``parallelize_model`` ->
``init_weights``) and trained on fixed global batches split Megatron's way (microbatch k of dp rank r holds
samples ``k·mbs·dp + r·mbs``), with the trainer's loss maths (masked mean / number of microbatches,
``no_sync`` for all but the last microbatch, aux-loss gradient scale 1 / number of microbatches). The
single-process oracle is the same code on one process (LocalTokenDispatcher, no process group).

Trainer level: ``longspan.training.pretrain.pretrain`` on ``tiny-moe`` (shrunk, mock data) for 8 iterations;
the per-iteration 'lm loss' of metrics.jsonl must match one process within 1e-4 relative.
"""

from __future__ import annotations

import math

import pytest

from tests.helpers.layout_parity import train_records
from tests.parallel.harness import get_shared_pool

SEQ = 32
MBS = 2
GBS = 8
REL_TOL = 1e-4


def moe_config(ep: int = 1, tp: int = 1, capacity: float | None = None, fsdp2: bool = False):
    """``tiny-moe`` shrunk for speed (2 layers, hidden 64), mock data, NullTokenizer, gloo."""
    from longspan.recipes import get_recipe
    from longspan.training.config import TokenizerConfig

    cfg = get_recipe("tiny-moe")
    m = cfg.model
    m.num_layers = 2
    m.hidden_size = 64
    m.ffn_hidden_size = 128
    m.moe_ffn_hidden_size = 32
    m.num_attention_heads = 4
    m.num_query_groups = 2
    m.seq_length = SEQ
    m.vocab_size = 256
    m.tensor_model_parallel_size = tp
    m.expert_model_parallel_size = ep
    m.moe_expert_capacity_factor = capacity
    m.moe_z_loss_coeff = 1e-3
    cfg.dataset.sequence_length = SEQ
    cfg.dataset.data_path = None
    cfg.tokenizer = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=255)
    cfg.dist.distributed_backend = "gloo"
    cfg.dist.distributed_timeout_minutes = 1
    cfg.dist.use_torch_fsdp2 = fsdp2
    cfg.train.micro_batch_size = MBS
    cfg.train.global_batch_size = GBS
    return cfg


def _global_batches(iters: int, vocab: int = 250, seed: int = 7):
    import torch

    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, vocab, (GBS, SEQ + 1), generator=g)
    mask = (torch.rand(GBS, SEQ, generator=g) > 0.2).float()
    return [(text, mask)] * iters


def train_moe_layout(cfg, iters: int = 3) -> dict:
    """Train ``iters`` iterations of ``cfg`` on this process's layout (model + optimizer level)."""
    from longspan.models.moe import moe_layer_metrics
    from longspan.models.moe_router import set_aux_loss_scale
    from tests.parallel.layout_training import build_layout_model, train_on_global_batches

    parallel, model, optimizer = build_layout_model(cfg)
    set_aux_loss_scale(1.0 / (GBS // (MBS * parallel.dp_size)))  # the schedule's aux-loss gradient scale
    losses, norms = train_on_global_batches(model, optimizer, parallel, _global_batches(iters), GBS, MBS)
    inner = getattr(model, "module", model)
    experts = inner.decoder.layers["0"].mlp.experts.linear_fc1.weight
    local_experts = (experts.to_local() if hasattr(experts, "to_local") else experts).shape
    metrics = moe_layer_metrics(inner)
    return {"losses": losses, "norms": norms, "local_expert_shape": tuple(local_experts),
            "tokens_per_expert": {k: v["tokens_per_expert"].tolist() for k, v in metrics.items()}}


def _layout_task(ep: int, tp: int, capacity: float | None = None, iters: int = 3) -> dict:
    return train_moe_layout(moe_config(ep=ep, tp=tp, capacity=capacity), iters=iters)


_REFERENCE: dict = {}


def _reference(capacity: float | None = None, iters: int = 3) -> dict:
    key = (capacity, iters)
    if key not in _REFERENCE:
        _REFERENCE[key] = train_moe_layout(moe_config(capacity=capacity), iters=iters)
    return _REFERENCE[key]


def _assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), (what, got, want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert math.isclose(g, w, rel_tol=REL_TOL), f"{what} iteration {i + 1}: {g} vs one process {w}"


@pytest.mark.slow
def test_ep2_matches_one_process():
    """EP2 (dp 2, DDP for dense weights): 2 experts per rank, same losses and gradient norms."""
    ref = _reference()
    results = get_shared_pool(2).run(_layout_task, 2, 1, timeout=240)
    for r in results:
        assert r["local_expert_shape"] == (2, 32, 64)  # no rank holds all 4 experts
        _assert_close(r["losses"], ref["losses"], "EP2 loss")
        _assert_close(r["norms"], ref["norms"], "EP2 grad norm")
    # the loss fell: the layouts trained a model, not a constant
    assert ref["losses"][-1] < ref["losses"][0] - 0.05


@pytest.mark.slow
def test_ep2_with_capacity_dropping_matches_one_process():
    """Token dropping happens at the router on each rank's own tokens, so the dropped set is layout-free."""
    ref = _reference(capacity=1.0, iters=2)
    results = get_shared_pool(2).run(_layout_task, 2, 1, 1.0, 2, timeout=240)
    for r in results:
        _assert_close(r["losses"], ref["losses"], "EP2 capacity 1.0 loss")
    dense = _reference(iters=2)
    assert ref["losses"][0] != dense["losses"][0]  # dropping changed the model's output


@pytest.mark.slow
def test_ep2_on_four_ranks_reduces_expert_grads_over_edp():
    """EP2 with dp 4: each expert lives on 2 ranks (expert-data-parallel 2), its gradient summed over them."""
    ref = _reference()
    results = get_shared_pool(4).run(_layout_task, 2, 1, timeout=300)
    for r in results:
        assert r["local_expert_shape"] == (2, 32, 64)
        _assert_close(r["losses"], ref["losses"], "EP2 dp4 loss")
        _assert_close(r["norms"], ref["norms"], "EP2 dp4 grad norm")


@pytest.mark.slow
def test_ep2_tp2_matches_one_process():
    """EP2 × TP2 on 4 ranks (etp = tp = 2, FSDP2 for dense weights): each rank holds 2 experts × half width."""
    ref = _reference()
    results = get_shared_pool(4).run(_layout_task, 2, 2, timeout=300)
    for r in results:
        assert r["local_expert_shape"] == (2, 16, 64)
        _assert_close(r["losses"], ref["losses"], "EP2xTP2 loss")
        _assert_close(r["norms"], ref["norms"], "EP2xTP2 grad norm")


# ------------------------------------------------------------------------------------- full pretrain path

ITERS = 8


def _pretrain_task(run_dir: str, ep: int = 1, tp: int = 1) -> None:
    from longspan.training.pretrain import pretrain

    cfg = moe_config(ep=ep, tp=tp)
    cfg.train.train_iters = ITERS
    cfg.train.eval_interval = None
    cfg.train.eval_iters = 0
    cfg.checkpoint.save = None
    cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir = run_dir
    cfg.logger.log_interval = 1
    cfg.model.moe_per_layer_logging = True
    pretrain(cfg)  # the default forward step: the schedule sets the aux-loss gradient scale


_PRETRAIN_REF: dict = {}


def _pretrain_reference(tmp_path_factory) -> list[dict]:
    if "rows" not in _PRETRAIN_REF:
        run_dir = str(tmp_path_factory.mktemp("moe_reference"))
        _pretrain_task(run_dir)
        _PRETRAIN_REF["rows"] = train_records(run_dir)
        _PRETRAIN_REF["dir"] = run_dir
    return _PRETRAIN_REF["rows"]


def _check_pretrain(rows: list[dict], ref: list[dict], what: str) -> None:
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1)) == [r["iteration"] for r in ref]
    for key in ("lm loss", "load_balancing_loss", "z_loss", "load_imbalance"):
        _assert_close([r["losses"][key] for r in rows], [r["losses"][key] for r in ref], f"{what} {key}")
    _assert_close([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref], f"{what} grad norm")


@pytest.mark.slow
def test_pretrain_logs_moe_metrics(tmp_path_factory):
    """One process: the MoE metrics reach metrics.jsonl and TensorBoard (per layer too), and the lm loss falls."""
    ref = _pretrain_reference(tmp_path_factory)
    first = ref[0]["losses"]
    assert 0.9 < first["load_balancing_loss"] < 1.5  # 1.0 is perfectly balanced routing
    assert first["load_imbalance"] >= 1.0 and first["z_loss"] > 0
    assert ref[-1]["losses"]["lm loss"] < first["lm loss"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(_PRETRAIN_REF["dir"])
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"load_balancing_loss", "load_imbalance", "moe/load_balancing_loss_layer_0",
            "moe/load_imbalance_layer_1"} <= tags
    values = [e.value for e in events.Scalars("load_balancing_loss")]
    assert values == pytest.approx([r["losses"]["load_balancing_loss"] for r in ref], rel=1e-6)


@pytest.mark.slow
def test_pretrain_ep2_matches_one_process(tmp_path_factory, tmp_path):
    ref = _pretrain_reference(tmp_path_factory)
    get_shared_pool(2).run(_pretrain_task, str(tmp_path), 2, 1, timeout=300)
    _check_pretrain(train_records(str(tmp_path)), ref, "pretrain EP2")


@pytest.mark.slow
def test_pretrain_ep2_tp2_matches_one_process(tmp_path_factory, tmp_path):
    ref = _pretrain_reference(tmp_path_factory)
    get_shared_pool(4).run(_pretrain_task, str(tmp_path), 2, 2, timeout=300)
    _check_pretrain(train_records(str(tmp_path)), ref, "pretrain EP2xTP2")


# ------------------------------------------------------------------------------------- layout checks (no processes)

def _fake_parallel(ep=1, etp=1, tp=1, cp=1):
    from types import SimpleNamespace

    return SimpleNamespace(ep_size=ep, etp_size=etp, tp_size=tp, cp_size=cp)


@pytest.mark.parametrize("layout, capacity, error, field", [
    (dict(ep=2, etp=1, tp=2), None, "NotSupportedError", "expert_tensor_parallel_size"),
    # token dropping would choose among each context-parallel rank's own chunks
    (dict(ep=2, cp=2), 1.0, "NotSupportedError", "moe_expert_capacity_factor"),
    (dict(ep=3), None, "ConfigError", "num_moe_experts"),
    (dict(etp=3, tp=3), None, "ConfigError", "moe_ffn_hidden_size"),
])
def test_unsupported_expert_layouts_raise_one_line(layout, capacity, error, field):
    from longspan.models.gpt import build_gpt_model
    from longspan.parallel.expert_parallel import check_expert_parallel

    model = build_gpt_model(moe_config(capacity=capacity).model, materialize=False)
    with pytest.raises(Exception) as info:
        check_expert_parallel(model, _fake_parallel(**layout))
    assert type(info.value).__name__ == error
    assert field in str(info.value) and "\n" not in str(info.value)


def test_context_parallel_and_sequence_parallel_expert_layouts_pass_the_checks():
    from longspan.models.gpt import build_gpt_model
    from longspan.parallel.expert_parallel import check_expert_parallel

    model = build_gpt_model(moe_config().model, materialize=False)
    for layout in (dict(ep=2, cp=2), dict(cp=2), dict(ep=2, etp=2, tp=2)):
        check_expert_parallel(model, _fake_parallel(**layout))


def test_dense_model_and_single_rank_experts_are_left_alone():
    from longspan.models.gpt import build_gpt_model
    from longspan.parallel.expert_parallel import apply_expert_parallel

    cfg = moe_config()
    moe_model = build_gpt_model(cfg.model, materialize=False)
    assert apply_expert_parallel(moe_model, _fake_parallel()) == []
    assert type(moe_model.decoder.layers["0"].mlp.token_dispatcher).__name__ == "LocalTokenDispatcher"
    cfg.model.num_moe_experts = None
    assert apply_expert_parallel(build_gpt_model(cfg.model, materialize=False), _fake_parallel(ep=2)) == []


def test_hidden_parameters_restores_them():
    import torch

    from longspan.parallel.expert_parallel import hidden_parameters

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    hide = [model[0].weight, model[1].bias]
    before = [n for n, _ in model.named_parameters()]
    with hidden_parameters(model, hide):
        assert [n for n, _ in model.named_parameters()] == ["0.bias", "1.weight"]
    assert sorted(n for n, _ in model.named_parameters()) == sorted(before)
    assert model[0].weight is hide[0] and model[1].bias is hide[1]
