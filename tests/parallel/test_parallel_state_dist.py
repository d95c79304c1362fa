"""Real process groups (gloo, 2 and 4 ranks via the harness): mesh groups, ParallelState, collectives."""

from __future__ import annotations

import logging

import pytest

from tests.parallel.harness import init_gloo
from tests.parallel.test_parallel_layout import naive_dense_groups, naive_expert_groups
from tests.parallel.test_parallel_launch_env import DistCfg, MPCfg

# starting a worker pool takes 5-20 s on a busy 2-core machine
pytestmark = pytest.mark.slow

LAYOUTS_4 = [  # (tp, cp, pp, dp_replicate, ep, etp, tp_pp_dp)
    (2, 1, 1, 1, 1, None, False), (1, 1, 2, 1, 1, None, False), (1, 2, 1, 1, 1, None, False),
    (2, 1, 2, 1, 1, None, False), (1, 1, 1, 2, 1, None, False), (2, 1, 2, 1, 1, None, True),
    (1, 1, 2, 1, 1, None, True), (2, 1, 1, 1, 2, 1, False), (1, 1, 1, 1, 4, 1, False), (1, 1, 2, 1, 2, 1, False),
]
DENSE = ("tp", "cp", "pp", "dp_replicate", "dp_shard", "dp", "dp_cp", "dp_shard_cp", "mp")


def _mesh_groups_for_layouts(layouts):
    """One task, many layouts: the groups this rank sees in each mesh dimension."""
    import torch.distributed as dist

    from longspan.parallel.mesh import build_device_mesh

    init_gloo(timeout_s=60)
    out = []
    for tp, cp, pp, dpr, ep, etp, mapping in layouts:
        meshes = build_device_mesh(dist.get_world_size(), tp=tp, cp=cp, pp=pp, dp_replicate=dpr, ep=ep, etp=etp,
                                   use_tp_pp_dp_mapping=mapping)
        got = {d: dist.get_process_group_ranks(meshes[d].get_group()) for d in DENSE}
        if meshes.expert_mesh is not None:
            got.update({d: dist.get_process_group_ranks(meshes[d].get_group()) for d in ("ep", "etp", "edp")})
        out.append(got)
    return out


def test_device_mesh_groups_match_megatron_enumeration(pool4):
    results = pool4.run(_mesh_groups_for_layouts, LAYOUTS_4)
    for i, (tp, cp, pp, dpr, ep, etp, mapping) in enumerate(LAYOUTS_4):
        dense = naive_dense_groups(4, tp, cp, pp, dpr, mapping)
        expert = naive_expert_groups(4, etp or tp, ep, pp, mapping) if (ep > 1 or (etp or tp) != tp) else None
        for rank in range(4):
            got = results[rank][i]
            for dim in DENSE:
                mine = [g for g in dense[dim] if rank in g]
                assert [got[dim]] == mine, (LAYOUTS_4[i], rank, dim)
            if expert is not None:
                for dim in ("ep", "etp", "edp"):
                    assert [got[dim]] == [g for g in expert[dim] if rank in g], (LAYOUTS_4[i], rank, dim)


def _state_for(mp_kwargs, dist_kwargs, dp_replicate=1):
    import torch.distributed as dist

    from longspan.parallel.collectives import all_gather_object
    from longspan.parallel.init import initialize_distributed

    ps = initialize_distributed(DistCfg(**dist_kwargs), MPCfg(**mp_kwargs), dp_replicate=dp_replicate)
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    summary = {
        "rank": ps.rank, "world": ps.world_size, "backend": ps.backend, "device": str(ps.device),
        "tp": (ps.tp_rank, ps.tp_size), "cp": (ps.cp_rank, ps.cp_size), "pp": (ps.pp_rank, ps.pp_size),
        "dp": (ps.dp_rank, ps.dp_size), "dpr": ps.dp_replicate_size, "dps": ps.dp_shard_size,
        "ep": (ps.ep_rank, ps.ep_size), "etp": ps.etp_size, "edp": ps.edp_size,
        "mp_group": dist.get_process_group_ranks(ps.mp_group),
        "dp_group": dist.get_process_group_ranks(ps.dp_group),
        "tp_group": dist.get_process_group_ranks(ps.tp_group),
        "pp_group": dist.get_process_group_ranks(ps.pp_group),
        "last": ps.is_last_rank, "pp_last": ps.is_pipeline_last_stage,
        "mesh_tp": dist.get_process_group_ranks(ps.mesh["tp"].get_group()),
        "ep_group": None if ps.ep_group is None else dist.get_process_group_ranks(ps.ep_group),
        # the dp group really works: gather over it
        "dp_gather": all_gather_object(ps.rank, group=ps.dp_group),
    }
    return summary


def test_parallel_state_tp2_pp2(pool4):
    out = pool4.run(_state_for, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
                    {"distributed_backend": "gloo"})
    for rank, s in enumerate(out):
        tp_rank, pp_rank = rank % 2, rank // 2  # rank = tp + 2*(dp + 1*pp), dp size 1
        assert (s["rank"], s["world"], s["backend"], s["device"]) == (rank, 4, "gloo", "cpu")
        assert s["tp"] == (tp_rank, 2) and s["pp"] == (pp_rank, 2) and s["dp"] == (0, 1) and s["cp"] == (0, 1)
        assert s["mp_group"] == [0, 1, 2, 3]  # tp × pp covers everything when dp = 1
        assert s["tp_group"] == s["mesh_tp"] == [pp_rank * 2, pp_rank * 2 + 1]
        assert s["pp_group"] == [tp_rank, tp_rank + 2]
        assert s["dp_group"] == [rank] and s["dp_gather"] == [rank]
        assert s["last"] == (rank == 3) and s["pp_last"] == (pp_rank == 1)
        assert s["ep"] == (0, 1) and s["ep_group"] is None and s["etp"] == 2 and s["edp"] == 1


def test_parallel_state_hybrid_dp4_and_experts(pool4):
    out = pool4.run(_state_for, {"tensor_model_parallel_size": 1, "expert_model_parallel_size": 2},
                    {"distributed_backend": "gloo"}, dp_replicate=2)
    for rank, s in enumerate(out):
        assert s["dp"] == (rank, 4) and s["dpr"] == 2 and s["dps"] == 2
        assert s["dp_group"] == [0, 1, 2, 3] and s["dp_gather"] == [0, 1, 2, 3]
        assert s["ep"] == (rank % 2, 2) and s["edp"] == 2 and s["etp"] == 1
        assert s["ep_group"] == [rank - rank % 2, rank - rank % 2 + 1]  # etp=1: ep is the fastest expert dim


def _nccl_fallback_warning_count():
    from longspan.parallel.init import initialize_distributed

    seen = []

    class Grab(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Grab(level=logging.INFO)
    logging.getLogger("longspan").addHandler(handler)
    ps = initialize_distributed(DistCfg(distributed_backend="nccl"), MPCfg(), device="cpu")
    logging.getLogger("longspan").removeHandler(handler)
    return ps.backend, [m for m in seen if "nccl" in m]


def test_cpu_nccl_falls_back_to_gloo_silently(pool2):
    """nccl is the default backend: on CPU it adapts to gloo without a warning."""
    out = pool2.run(_nccl_fallback_warning_count)
    assert [backend for backend, _ in out] == ["gloo", "gloo"]
    assert [line for _, msgs in out for line in msgs] == []


def _collectives_case():
    from longspan.parallel import collectives as C
    from longspan.parallel.init import initialize_distributed

    ps = initialize_distributed(DistCfg(distributed_backend="gloo"), MPCfg(tensor_model_parallel_size=2))
    r = ps.rank
    return {
        "max": C.all_reduce_max(float(r) * 1.5),
        "sum": C.all_reduce_sum(r + 0.25),
        "tp_sum": C.all_reduce_sum(float(r), group=ps.tp_group),
        "and_all": C.logical_and(True),
        "and_one_false": C.logical_and(r != 2),
        "or_one_true": C.logical_or(r == 3, group=ps.tp_group),
        "bcast": C.broadcast_object({"from": r, "data": [1, 2]} if r == 0 else None),
        "bcast_tp": C.broadcast_object(f"tp-src-{r}", src=r - ps.tp_rank, group=ps.tp_group),
        "gather": C.all_gather_object(r * 10, group=ps.tp_group),
        "barrier": C.barrier(ps.dp_group),
    }


def test_collectives_over_world_and_subgroups(pool4):
    out = pool4.run(_collectives_case)
    for r, res in enumerate(out):
        tp_first = r - r % 2
        assert res["max"] == 4.5 and res["sum"] == 0 + 1 + 2 + 3 + 1.0
        assert res["tp_sum"] == tp_first + tp_first + 1
        assert res["and_all"] is True and res["and_one_false"] is False
        assert res["or_one_true"] == (tp_first == 2)
        assert res["bcast"] == {"from": 0, "data": [1, 2]}
        assert res["bcast_tp"] == f"tp-src-{tp_first}"
        assert res["gather"] == [tp_first * 10, tp_first * 10 + 10]
        assert res["barrier"] is None



def _copy_reduce_case():
    import torch

    from longspan.parallel.collectives import copy_to_group, reduce_from_group
    from longspan.parallel.init import initialize_distributed

    ps = initialize_distributed(DistCfg(distributed_backend="gloo"), MPCfg(tensor_model_parallel_size=2))
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = reduce_from_group(copy_to_group(x, ps.tp_group) * (ps.tp_rank + 1), ps.tp_group)
    (y * torch.tensor([1.0, 10.0])).sum().backward()
    return y.tolist(), x.grad.tolist()


def test_copy_to_group_and_reduce_from_group_are_a_split_computation(pool2):
    """Rank r computes (r+1)·x: the sum over the group is 3x, and x's gradient the sum of both ranks' (r+1)·g."""
    for y, grad in pool2.run(_copy_reduce_case):
        assert y == [3.0, 6.0] and grad == [3.0, 30.0]
