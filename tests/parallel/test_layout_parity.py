"""Layout parity (issue 5): every parallel layout trains the same model as one process.

Model + optimizer level: a shrunk ``tiny`` recipe (seq 64) is built exactly as the trainer builds it (meta
model -> ``parallelize_model`` -> ``init_weights``), trained for a few iterations of one global batch split
Megatron's way (microbatch k of dp rank r holds samples ``k·mbs·dp + r·mbs ...``), with the trainer's loss
maths (per-microbatch masked mean / number of microbatches, ``no_sync`` for all but the last microbatch, DP
averaging) and the Megatron optimizer. The oracle is the same loop in one process without any parallel
plan, computed once per session.
"""

from __future__ import annotations

import math

import pytest

from tests.parallel.harness import get_shared_pool

pytestmark = pytest.mark.slow

SEQ = 64
MBS = 2
GBS = 8
ITERS = 4
REL_TOL = 1e-4


def tiny_config(tp: int = 1, sp: bool = False, fsdp2: bool = False, dist_opt: bool = False,
                seq: int = SEQ, **model_overrides):
    """The ``tiny`` recipe shrunk for speed, with mock data and a fixed learning rate."""
    from longspan.recipes.tiny import tiny
    from longspan.training.config import TokenizerConfig

    cfg = tiny()
    cfg.model.seq_length = seq
    cfg.dataset.sequence_length = seq
    cfg.dataset.data_path = None
    cfg.tokenizer = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=4096)
    cfg.model.tensor_model_parallel_size = tp
    cfg.model.sequence_parallel = sp
    for key, value in model_overrides.items():
        setattr(cfg.model, key, value)
    cfg.dist.use_torch_fsdp2 = fsdp2
    cfg.dist.distributed_backend = "gloo"
    cfg.dist.distributed_timeout_minutes = 1
    cfg.optimizer.use_distributed_optimizer = dist_opt
    cfg.ddp.use_distributed_optimizer = dist_opt
    cfg.train.micro_batch_size = MBS
    cfg.train.global_batch_size = GBS
    return cfg


def global_batches(iters: int, seq: int = SEQ, vocab: int = 4000, seed: int = 7):
    """``iters`` global batches ``(tokens [GBS, seq + 1], loss_mask [GBS, seq])``."""
    import torch

    # One batch repeated: the model memorizes it, so the loss falls far between iterations and a layout
    # that trained a different model would show. Uneven mask counts per microbatch exercise the normalization.
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, vocab, (GBS, seq + 1), generator=g)
    mask = (torch.rand(GBS, seq, generator=g) > 0.2).float()
    return [(text, mask)] * iters


def train_layout(cfg, iters: int = ITERS, dp_replicate: int = 1, return_grads: bool = False) -> dict:
    """Train ``iters`` iterations of ``cfg`` on this process's layout; per-iteration global losses etc."""
    import torch
    import torch.distributed as dist

    from longspan.models.gpt import build_gpt_model, init_weights
    from longspan.parallel.init import initialize_distributed
    from longspan.parallel.parallelize import parallel_loss_context, parallelize_model
    from longspan.training.optimizer import get_megatron_optimizer

    parallel = initialize_distributed(cfg.dist, cfg.model, dp_replicate=dp_replicate, device="cpu")
    cfg.model.finalize()
    torch.manual_seed(1234)
    model = build_gpt_model(cfg.model, materialize=False)
    model = parallelize_model(model, cfg, parallel)
    init_weights(model, seed=cfg.rng.seed, device=parallel.device)
    model.train()
    optimizer = get_megatron_optimizer(cfg.optimizer, [model])
    dp, dp_rank = parallel.dp_size, parallel.dp_rank
    num_mb = GBS // (MBS * dp)
    losses, norms = [], []
    for text, mask in global_batches(iters, seq=cfg.model.seq_length):
        optimizer.zero_grad()
        mb_means = []
        for k in range(num_mb):
            start = k * MBS * dp + dp_rank * MBS
            tokens, labels = text[start:start + MBS, :-1], text[start:start + MBS, 1:]
            loss_mask = mask[start:start + MBS]
            last = k == num_mb - 1
            sync = contextlib_null() if last or not hasattr(model, "no_sync") else model.no_sync()
            with sync, parallel_loss_context(model):
                per_token = model(tokens, labels=labels)
                mean = (per_token * loss_mask).sum() / loss_mask.sum()
                (mean / num_mb).backward()
            mb_means.append(mean.detach())
        ok, norm, _ = optimizer.step()
        loss = torch.stack(mb_means).sum()
        if dp > 1:
            dist.all_reduce(loss, group=parallel.dp_group)
        losses.append(float(loss) / (num_mb * dp))
        norms.append(float(norm))
    result = {"losses": losses, "norms": norms, "rank": parallel.rank, "wrapper": type(model).__name__}
    if return_grads:
        result["model"] = model
    return result


def contextlib_null():
    import contextlib

    return contextlib.nullcontext()


def _close(got: list[float], want: list[float], rel: float = REL_TOL) -> bool:
    return all(math.isclose(g, w, rel_tol=rel) for g, w in zip(got, want)) and len(got) == len(want)


@pytest.fixture(scope="session")
def reference_losses() -> dict:
    """The single-process run (no process group, no plan), once per session."""
    return train_layout(tiny_config())


LAYOUTS_2 = {  # name: (config overrides, dp_replicate, expected wrapper class)
    "dp2_ddp": (dict(), 1, "DistributedDataParallel"),
    "dp2_fsdp2": (dict(fsdp2=True), 1, "FSDPGPTModel"),
    "dp2_distopt": (dict(dist_opt=True), 1, "FSDPGPTModel"),
    "dp2_hybrid": (dict(fsdp2=True), 2, "FSDPGPTModel"),
    "tp2": (dict(tp=2), 1, "GPTModel"),
    "tp2_sp": (dict(tp=2, sp=True), 1, "GPTModel"),
}


def _check(name: str, results: list[dict], reference: dict, wrapper: str) -> None:
    want = reference["losses"]
    # the loss moves a lot: a layout training a different model could not stay within the tolerance
    assert want[-1] < want[0] * 0.95
    for r in results:
        assert r["wrapper"] == wrapper
        assert _close(r["losses"], want), f"{name} rank {r['rank']}: {r['losses']} vs one process {want}"
        assert _close(r["norms"], reference["norms"], 1e-3), f"{name}: grad norms {r['norms']}"


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_two_rank_layout_matches_one_process(name, reference_losses):
    overrides, dp_replicate, wrapper = LAYOUTS_2[name]
    results = get_shared_pool(2).run(train_layout, tiny_config(**overrides), dp_replicate=dp_replicate,
                                     timeout=240)
    _check(name, results, reference_losses, wrapper)


def test_dp2_tp2_on_four_ranks_matches_one_process(reference_losses):
    # default config (DDP requested): with tensor parallel the data-parallel wrapper is FSDP2
    results = get_shared_pool(4).run(train_layout, tiny_config(tp=2), timeout=300)
    _check("dp2xtp2", results, reference_losses, "FSDPGPTModel")
