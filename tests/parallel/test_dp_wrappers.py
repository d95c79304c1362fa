"""Data-parallel wrappers: DDP settings, FSDP2 per-block wrapping and no_sync, the distributed optimizer's
sharded state, hybrid sharding. End-to-end loss parity lives in test_layout_parity.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from longspan.core.errors import NotSupportedError
from tests.parallel.harness import get_shared_pool, init_gloo


def _cfg(fsdp2=False, dist_opt=False, **ddp):
    from longspan.training.config import DistributedDataParallelConfig, DistributedInitConfig, OptimizerConfig

    return SimpleNamespace(
        dist=DistributedInitConfig(distributed_backend="gloo", distributed_timeout_minutes=1,
                                   use_torch_fsdp2=fsdp2),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, **ddp),
        optimizer=OptimizerConfig(lr=1e-3, use_distributed_optimizer=dist_opt),
    )


# ------------------------------------------------------------------------------------------ no processes

def test_mode_follows_the_config():
    from longspan.parallel.data_parallel import data_parallel_mode

    assert data_parallel_mode(_cfg()) == "ddp"
    assert data_parallel_mode(_cfg(fsdp2=True)) == "fsdp2"
    assert data_parallel_mode(_cfg(dist_opt=True)) == "distributed_optimizer"
    assert data_parallel_mode(_cfg(fsdp2=True, dist_opt=True)) == "fsdp2"


def test_mixed_precision_policy_from_model_and_ddp():
    from longspan.parallel.data_parallel import mixed_precision_policy

    bf16 = mixed_precision_policy(SimpleNamespace(bf16=True, fp16=False), SimpleNamespace(grad_reduce_in_fp32=True))
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp16 = mixed_precision_policy(SimpleNamespace(bf16=False, fp16=True), SimpleNamespace(grad_reduce_in_fp32=False))
    assert (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, None)
    fp32 = mixed_precision_policy(SimpleNamespace(bf16=False, fp16=False), SimpleNamespace(grad_reduce_in_fp32=True))
    assert (fp32.param_dtype, fp32.reduce_dtype) == (None, None)


def test_bad_bucket_size_is_rejected_in_one_line():
    from longspan.parallel.data_parallel import check_data_parallel_config

    with pytest.raises(NotSupportedError, match="bucket_size"):
        check_data_parallel_config(_cfg(bucket_size=0))


# ------------------------------------------------------------------------------------------ on 2 gloo ranks

def _ddp_checks() -> dict:
    import torch.distributed as dist
    from torch import nn

    from longspan.parallel.data_parallel import apply_ddp

    init_gloo(timeout_s=60)
    rank = dist.get_rank()
    out: dict = {}
    cfg = _cfg(bucket_size=1000)
    with torch.device("meta"):
        meta = nn.Linear(8, 4)
    wrapped = apply_ddp(meta, None, torch.device("cpu"), cfg.ddp, param_dtype=torch.float32)
    out["bucket_bytes_cap"] = wrapped.bucket_bytes_cap
    out["has_no_sync"] = callable(getattr(wrapped, "no_sync", None))
    out["materialized"] = not any(p.is_meta for p in wrapped.parameters())

    def reduced_vs_expected(ddp_cfg, dtype):
        torch.manual_seed(0)  # same weights on both ranks
        plain = nn.Linear(8, 4).to(dtype)
        copy = nn.Linear(8, 4).to(dtype)
        copy.load_state_dict(plain.state_dict())
        model = apply_ddp(copy, None, torch.device("cpu"), ddp_cfg, param_dtype=dtype)
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(10 + rank)).to(dtype)
        plain(x).float().pow(2).sum().backward()
        model(x).float().pow(2).sum().backward()
        local = plain.weight.grad
        gathered = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(gathered, local)
        return model.module.weight.grad, gathered

    # replicas that initialized differently start equal: rank 0's weights are broadcast at the first forward
    torch.manual_seed(100 + rank)
    differing = apply_ddp(nn.Linear(8, 4), None, torch.device("cpu"), cfg.ddp)
    torch.manual_seed(100)
    rank0_weight = nn.Linear(8, 4).weight.detach().clone()
    differing(torch.ones(1, 8))
    out["broadcast_at_first_forward"] = torch.equal(differing.module.weight, rank0_weight)

    # bf16 gradients averaged in fp32: (g0/2 + g1/2) computed in fp32, rounded once to bf16
    got, (g0, g1) = reduced_vs_expected(_cfg(grad_reduce_in_fp32=True).ddp, torch.bfloat16)
    out["fp32_reduce_exact"] = torch.equal(got, (g0.float() / 2 + g1.float() / 2).to(torch.bfloat16))
    # average_in_collective on gloo (no ReduceOp.AVG): the same mean
    got, (g0, g1) = reduced_vs_expected(_cfg(average_in_collective=True).ddp, torch.float32)
    out["avg_in_collective_diff"] = float((got - (g0 + g1) / 2).abs().max())
    return out


@pytest.mark.slow
def test_ddp_honours_bucket_size_fp32_reduction_and_averaging():
    for r in get_shared_pool(2).run(_ddp_checks, timeout=120):
        assert r["bucket_bytes_cap"] == 1000 * 4  # bucket_size elements of fp32
        assert r["has_no_sync"] and r["materialized"]
        assert r["broadcast_at_first_forward"]
        assert r["fp32_reduce_exact"]
        assert r["avg_in_collective_diff"] < 1e-6


def _fsdp_checks(mode: str, dp_replicate: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from longspan.models.gpt import build_gpt_model, init_weights
    from longspan.parallel.init import initialize_distributed
    from longspan.parallel.parallelize import parallelize_model
    from longspan.training.optim.optimizer import get_megatron_optimizer
    from tests.parallel.test_tp_plans import small_provider

    cfg = _cfg(fsdp2=mode == "fsdp2", dist_opt=mode == "distributed_optimizer")
    cfg.model = small_provider()
    parallel = initialize_distributed(cfg.dist, cfg.model, dp_replicate=dp_replicate, device="cpu")
    model = parallelize_model(build_gpt_model(cfg.model, materialize=False), cfg, parallel)
    init_weights(model, seed=3, device="cpu")
    whole = build_gpt_model(cfg.model, seed=3, device="cpu")
    out: dict = {"layers_sharded": all(isinstance(m, FSDPModule) for m in model.decoder.layers.values()),
                 "root_sharded": isinstance(model, FSDPModule)}
    q = model.decoder.layers["0"].self_attention.linear_q.weight
    out["placements"] = tuple(str(p) for p in q.placements)
    out["mesh_shape"] = tuple(q.device_mesh.shape)
    out["init_matches"] = all(
        torch.equal(p.full_tensor(), dict(whole.named_parameters())[n]) for n, p in model.named_parameters()
    )

    calls = {"reduce_scatter": 0}
    original = dist.reduce_scatter_single

    def counting(*args, **kwargs):
        calls["reduce_scatter"] += 1
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counting
    try:
        tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(parallel.rank))

        def look_at_layer_0(module, args, output):  # layer 0 has finished its forward by now
            out["layer_param_sharded_after_forward"] = isinstance(
                model.decoder.layers["0"].self_attention.linear_q.weight, DTensor)

        hook = model.decoder.layers["1"].register_forward_hook(look_at_layer_0)
        with model.no_sync():
            model(tokens, labels=tokens).mean().backward()
        hook.remove()
        out["reduce_scatters_in_no_sync"] = calls["reduce_scatter"]
        model(tokens, labels=tokens).mean().backward()
        out["reduce_scatters_after"] = calls["reduce_scatter"]
    finally:
        dist.reduce_scatter_single = original
    optimizer = get_megatron_optimizer(cfg.optimizer, [model])
    optimizer.step()
    state = optimizer.optimizer.state[q]
    out["exp_avg_is_dtensor"] = isinstance(state["exp_avg"], DTensor)
    out["exp_avg_local_rows"] = state["exp_avg"].to_local().shape[0]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp2", "distributed_optimizer"])
def test_fsdp2_wraps_blocks_syncs_on_the_last_microbatch_and_shards_optimizer_state(mode):
    for r in get_shared_pool(2).run(_fsdp_checks, mode, 1, timeout=120):
        assert r["layers_sharded"] and r["root_sharded"]
        assert r["placements"] == ("S(0)",) and r["mesh_shape"] == (2,)
        assert r["init_matches"]  # the same full weights as one process
        assert r["reduce_scatters_in_no_sync"] == 0
        assert r["reduce_scatters_after"] > 0
        # fsdp2 reshards layers after forward (ZeRO-3); the distributed optimizer keeps them gathered
        assert r["layer_param_sharded_after_forward"] is (mode == "fsdp2")
        assert r["exp_avg_is_dtensor"] and r["exp_avg_local_rows"] == 32 // 2  # q rows: 4 heads × 8 / dp 2


@pytest.mark.slow
def test_hybrid_sharding_replicates_across_replicas():
    for r in get_shared_pool(2).run(_fsdp_checks, "fsdp2", 2, timeout=120):
        assert r["placements"] == ("R", "S(0)") and r["mesh_shape"] == (2, 1)
        assert r["init_matches"] and r["exp_avg_is_dtensor"]
        assert r["exp_avg_local_rows"] == 32  # one shard per replica: each replica holds it whole
