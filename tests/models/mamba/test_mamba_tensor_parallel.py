"""Mamba mixers under tensor, sequence and context parallel (longspan.parallel.mamba, mamba_context_parallel).

Each layout trains the tiny model through ``parallelize_model`` for 8 Adam steps on 2 ranks (in the shared
worker pool) with an uneven loss mask; the losses must equal one process's (computed once in the parent)
within 1e-5 relative. Under TP2 each rank must hold about half of the parameters: the mixer's tensors are
sharded by heads, not replicated (measured as the sum of local numel × element size, printed).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from longspan.core.errors import ConfigError
from longspan.models.mamba import build_mamba_model
from longspan.parallel.mamba import apply_mamba_tensor_parallel
from tests.models.mamba.mamba_test_config import hybrid_config, mamba_config
from tests.parallel.harness import get_shared_pool

ITERS, BATCH, SEQ, VOCAB, SEED = 8, 2, 16, 128, 11
REL = 1e-5


def _provider(hybrid: bool, **layout):
    make = hybrid_config if hybrid else mamba_config
    return make(vocab_size=VOCAB, seq_length=SEQ, **layout)


def _batches():
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) < 0.7).float()  # uneven token counts per row
    return [(ids, labels, mask)] * ITERS  # one batch, learnt: the loss must fall


def _train(model, context=None) -> list[float]:
    import contextlib

    import torch

    torch.manual_seed(1)  # the dropout masks: one process's and every rank's draw the same
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for ids, labels, mask in _batches():
        with context(model) if context is not None else contextlib.nullcontext():  # (vocab-parallel loss)
            loss = (model(ids, labels=labels) * mask).sum() / mask.sum()
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _parameter_bytes(model) -> int:
    """This process's parameter memory: local shards of DTensors, whole plain tensors."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _layout_case(hybrid: bool, layout: dict) -> dict:
    from longspan.models.init import init_weights
    from longspan.parallel.init import initialize_distributed
    from longspan.parallel.parallelize import parallel_loss_context, parallelize_model
    from longspan.training.config import ConfigContainer, DistributedInitConfig

    provider = _provider(hybrid, **layout)
    cfg = ConfigContainer(model=provider, dist=DistributedInitConfig(distributed_backend="gloo",
                                                                     distributed_timeout_minutes=1))
    parallel = initialize_distributed(cfg.dist, provider, device="cpu")
    model = parallelize_model(build_mamba_model(provider, materialize=False), cfg, parallel)
    init_weights(model, seed=SEED, device="cpu")
    inner = getattr(model, "module", model)
    mixer = inner.decoder.layers["0"].mixer
    mixer_bytes = _parameter_bytes(mixer)
    lengths = []  # the residual stream's local sequence length (sp and cp cut it)
    inner.decoder.layers["0"].register_forward_hook(lambda _m, _a, out: lengths.append(out.shape[1]))
    return {"losses": _train(model, parallel_loss_context), "bytes": _parameter_bytes(inner),
            "mixer_bytes": mixer_bytes, "exchange": repr(mixer.context_parallel), "local_seq": lengths[0]}


PARALLEL_FIELDS = ("tensor_model_parallel_size", "sequence_parallel", "context_parallel_size")


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The one-process runs, by (hybrid, the layout's model fields), computed once each."""
    out: dict = {}

    def run(hybrid: bool, layout: dict) -> dict:
        fields = {k: v for k, v in layout.items() if k not in PARALLEL_FIELDS}
        key = (hybrid, repr(sorted(fields.items())))
        if key not in out:
            model = build_mamba_model(_provider(hybrid, **fields), seed=SEED)
            out[key] = {"bytes": _parameter_bytes(model),
                        "mixer_bytes": _parameter_bytes(model.decoder.layers["0"].mixer),
                        "losses": _train(model)}
        return out[key]

    return run


LAYOUTS = {  # name: (hybrid stack, model fields); each proves a different path
    "tp2": (False, dict(tensor_model_parallel_size=2)),  # heads sharded: memory and losses
    # M, attention and MLP layers on sequence shards; their residual dropouts draw one process's masks
    "tp2_sp": (True, dict(tensor_model_parallel_size=2, sequence_parallel=True, hidden_dropout=0.2)),
    "cp2": (True, dict(context_parallel_size=2)),  # all-to-all to heads, attention's K/V all-gather beside it
    # the attention layer's sliding window on the global positions of each rank's sequence chunks
    "cp2_window": (True, dict(context_parallel_size=2, window_size=[3, 0])),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_as_one_process(name: str, one_process) -> None:
    hybrid, layout = LAYOUTS[name]
    want = one_process(hybrid, layout)
    results = get_shared_pool(2).run(_layout_case, hybrid, layout, timeout=180)
    for rank, got in enumerate(results):
        for i, (g, w) in enumerate(zip(got["losses"], want["losses"], strict=True)):
            assert abs(g - w) <= REL * abs(w), f"{name} rank {rank} loss[{i}]: {g} vs {w}"
    assert want["losses"][-1] < want["losses"][0]
    assert [r["local_seq"] for r in results] == [SEQ if name == "tp2" else SEQ // 2] * 2
    if name.startswith("cp"):
        assert "all-to-all over 2 ranks" in results[0]["exchange"]
    if "window_size" in layout:  # the window reaches the attention layer: one process trains otherwise without it
        assert want["losses"] != one_process(hybrid, {})["losses"]
    if name == "tp2":
        model_ratio = [r["bytes"] / want["bytes"] for r in results]
        mixer_ratio = [r["mixer_bytes"] / want["mixer_bytes"] for r in results]
        print(f"\nTP2 parameter bytes per rank: model {[r['bytes'] for r in results]} vs one process "
              f"{want['bytes']} (ratio {model_ratio}); mixer {[r['mixer_bytes'] for r in results]} vs "
              f"{want['mixer_bytes']} (ratio {mixer_ratio})")
        assert max(model_ratio) <= 0.6
        assert max(mixer_ratio) == 0.5


def test_indivisible_heads_are_one_line_errors() -> None:
    mesh = SimpleNamespace(size=lambda: 2)
    model = build_mamba_model(mamba_config(mamba_num_groups=1), materialize=False)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=2 must divide the Mamba heads"):
        apply_mamba_tensor_parallel(model, mesh)
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2 × model.context_parallel_size=2 must"):
        build_mamba_model(mamba_config(tensor_model_parallel_size=2, context_parallel_size=2), materialize=False)
