"""Muon (optimizer.optimizer='muon') under sharded layouts updates every matrix as one process would.

- ``pretrain`` of the tiny GPT with Muon for 8 iterations under TP2 (``muon_tp_mode='duplicated'``: each
  tensor-parallel matrix gathered whole) and DP2 with FSDP2 (the distributed optimizer's shards gathered): every
  iteration's loss and gradient norm within 1e-5 (relative) of one process's.
- At optimizer level on a tp=2 mesh: a column- and a row-parallel matrix step to the one-process update with
  'duplicated', and with 'blockwise' (Megatron's default) each rank's block is orthogonalised on its own.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.layout_parity import logged
from tests.parallel.harness import get_shared_pool
from tests.training.pretrain_helpers import mock_layout_run

ITERS = 8
REL = 1e-5


def _config(run_dir: str, tp: int = 1, fsdp2: bool = False):
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups = 2, 32, 64, 4, 2
    m.tensor_model_parallel_size = tp
    cfg.dist.use_torch_fsdp2 = fsdp2
    o = cfg.optimizer
    o.optimizer, o.muon_tp_mode, o.muon_use_nesterov, o.muon_extra_scale_factor = "muon", "duplicated", True, 0.2
    o.muon_fp32_matmul_prec = "highest"
    return mock_layout_run(cfg, f"{run_dir}/tb", 32, 2, 8, ITERS)


def _pretrain(run_dir: str, **layout) -> int:
    from longspan.training.pretrain import pretrain

    return pretrain(_config(run_dir, **layout)).train_state.step


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = str(tmp_path_factory.mktemp("one"))
    assert _pretrain(run_dir) == ITERS
    return logged(os.path.join(run_dir, "tb"))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [dict(tp=2), dict(fsdp2=True)], ids=["tp2", "dp2_fsdp2"])
def test_layout_matches_one_process(layout: dict, one_process, tmp_path) -> None:
    want = one_process
    assert want["losses"][-1] < want["losses"][0] * 0.95  # the reference trained
    get_shared_pool(2).run(_pretrain, str(tmp_path), timeout=200, **layout)
    got = logged(os.path.join(str(tmp_path), "tb"))
    assert got["iterations"] == want["iterations"] == list(range(1, ITERS + 1))
    for key in ("losses", "norms"):
        for i, (g, w) in enumerate(zip(got[key], want[key], strict=True)):
            assert abs(g - w) <= REL * abs(w), f"{layout} {key}[{i}]: {g} vs one process {w}"


def _tp_step(mode: str) -> dict:
    """One Muon step of a column-parallel (Shard(0)) and a row-parallel (Shard(1)) matrix on a tp=2 mesh, and
    what one process computes from the whole matrices: the whole-matrix update and each tp block's own."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from longspan.config.schema.optim import OptimizerConfig
    from longspan.training.optim.muon import muon_scale, newton_schulz
    from longspan.training.optim.optimizer import get_megatron_optimizer
    from tests.parallel.harness import init_gloo

    init_gloo(timeout_s=60)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    whole = {"column": torch.randn(8, 6, generator=g), "row": torch.randn(6, 8, generator=g)}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in whole.items()}
    model = nn.Module()
    for (name, w), dim in zip(whole.items(), (0, 1)):
        model.register_parameter(name, nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(dim)])))
        getattr(model, name).grad = distribute_tensor(grads[name].clone(), mesh, [Shard(dim)])
    cfg = OptimizerConfig(optimizer="muon", lr=0.1, weight_decay=0.0, clip_grad=0.0, muon_tp_mode=mode,
                          muon_fp32_matmul_prec="highest")
    get_megatron_optimizer(cfg, [model]).step()
    rank, errors = torch.distributed.get_rank(), {}
    for (name, w), dim in zip(whole.items(), (0, 1)):
        got = getattr(model, name)
        assert isinstance(got, DTensor) and got.placements == (Shard(dim),)
        if mode == "duplicated":
            want = w - 0.1 * newton_schulz(grads[name], 5, "highest") * muon_scale(*w.shape, "spectral")
            errors[name] = float((got.full_tensor() - want).abs().max())
        else:
            block = grads[name].chunk(2, dim)[rank]
            update = newton_schulz(block, 5, "highest") * muon_scale(*block.shape, "spectral")
            errors[name] = float((got.to_local() - (w.chunk(2, dim)[rank] - 0.1 * update)).abs().max())
    return errors


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["duplicated", "blockwise"])
def test_tensor_parallel_matrices_step_whole_or_blockwise(mode: str) -> None:
    for rank, errors in enumerate(get_shared_pool(2).run(_tp_step, mode, timeout=100)):
        assert all(err < 1e-6 for err in errors.values()), (mode, rank, errors)
