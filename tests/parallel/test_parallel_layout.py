"""Pure layout arithmetic: rank order against a naive enumeration of Megatron's groups, and layout errors."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from longspan.core.errors import ConfigError, LaunchError
from longspan.parallel.mesh import FLATTENED_DIMS, check_layout, derive_layout, rank_groups

# --------------------------------------------------------------------------- naive oracle (written out here)


def naive_dense_groups(world, tp, cp, pp, dpr=1, tp_pp_dp=False):
    """Megatron's groups by brute force: rank = tp + TP*(cp + CP*(dp + DP*pp)) for order tp-cp-dp-pp, or
    tp + TP*(cp + CP*(pp + PP*dp)) for tp-cp-pp-dp. dp = dp_replicate*dp_shard + dp_shard_rank (shards inner).
    Returns {dim: sorted list of groups}; the members of a group are listed with the order string's earlier
    (faster) dimension varying fastest, as Megatron's generate_masked_orthogonal_rank_groups does."""
    dp = world // (tp * cp * pp)
    dps = dp // dpr

    def rank(t, c, d, p):
        if tp_pp_dp:
            return t + tp * (c + cp * (p + pp * d))
        return t + tp * (c + cp * (d + dp * p))

    coords = list(itertools.product(range(tp), range(cp), range(dpr), range(dps), range(pp)))

    def groups(varying):
        # varying: dims listed fastest first; every other coordinate fixed
        out = {}
        for t, c, r, s, p in coords:
            cur = {"tp": t, "cp": c, "dp_replicate": r, "dp_shard": s, "pp": p}
            key = tuple(v for k, v in cur.items() if k not in varying)
            out.setdefault(key, {})
            idx = tuple(cur[k] for k in reversed(varying))  # slowest first for sorting
            out[key][idx] = rank(t, c, r * dps + s, p)
        return sorted(([g[i] for i in sorted(g)] for g in out.values()), key=lambda g: g[0])

    return {
        "tp": groups(["tp"]), "cp": groups(["cp"]), "pp": groups(["pp"]),
        "dp_replicate": groups(["dp_replicate"]), "dp_shard": groups(["dp_shard"]),
        "dp": groups(["dp_shard", "dp_replicate"]),
        "dp_cp": groups(["cp", "dp_shard", "dp_replicate"]),
        "dp_shard_cp": groups(["cp", "dp_shard"]),
        "mp": groups(["tp", "pp"]),
    }


def naive_expert_groups(world, etp, ep, pp, tp_pp_dp=False):
    """Megatron's expert generator: order etp-ep-edp-pp (or etp-ep-pp-edp), edp = world / (etp*ep*pp)."""
    edp = world // (etp * ep * pp)

    def rank(t, e, d, p):
        if tp_pp_dp:
            return t + etp * (e + ep * (p + pp * d))
        return t + etp * (e + ep * (d + edp * p))

    def groups(dim):
        out = {}
        for t, e, d, p in itertools.product(range(etp), range(ep), range(edp), range(pp)):
            cur = {"etp": t, "ep": e, "edp": d, "pp": p}
            key = tuple(v for k, v in cur.items() if k != dim)
            out.setdefault(key, []).append((cur[dim], rank(t, e, d, p)))
        return sorted(([r for _, r in sorted(g)] for g in out.values()), key=lambda g: g[0])

    return {"etp": groups("etp"), "ep": groups("ep"), "edp": groups("edp"), "pp": groups("pp")}


DENSE_CASES = [  # (world, tp, cp, pp, dp_replicate, tp_pp_dp)
    (8, 2, 1, 1, 1, False), (8, 1, 1, 2, 1, False), (8, 2, 1, 2, 1, False), (8, 2, 2, 2, 1, False),
    (8, 1, 2, 1, 1, False), (16, 2, 2, 2, 1, False), (8, 1, 1, 1, 2, False), (16, 2, 1, 2, 2, False),
    (16, 1, 2, 1, 2, False), (8, 2, 1, 2, 1, True), (16, 2, 1, 2, 1, True), (16, 2, 2, 1, 1, True),
    (12, 2, 1, 3, 1, False), (12, 3, 1, 2, 2, True), (4, 4, 1, 1, 1, False), (1, 1, 1, 1, 1, False),
]


@pytest.mark.parametrize("world,tp,cp,pp,dpr,mapping", DENSE_CASES)
def test_dense_groups_match_naive_megatron_enumeration(world, tp, cp, pp, dpr, mapping):
    layout = derive_layout(world, tp=tp, cp=cp, pp=pp, dp_replicate=dpr, use_tp_pp_dp_mapping=mapping)
    names, sizes = layout.dense_dims()
    expected = naive_dense_groups(world, tp, cp, pp, dpr, mapping)
    for dim in ("tp", "cp", "pp", "dp_replicate", "dp_shard"):
        assert rank_groups(names, sizes, dim) == expected[dim], dim
    for flat, parts in FLATTENED_DIMS.items():
        assert rank_groups(names, sizes, parts) == expected[flat], flat


EXPERT_CASES = [  # (world, tp, pp, ep, etp, tp_pp_dp)
    (8, 2, 1, 2, 1, False), (8, 2, 1, 4, 2, False), (8, 1, 2, 2, 1, False), (16, 2, 2, 2, None, False),
    (8, 2, 1, 2, 2, False), (8, 1, 1, 8, 1, False), (8, 2, 2, 2, 1, True), (8, 1, 1, 2, 2, True),
]


@pytest.mark.parametrize("world,tp,pp,ep,etp,mapping", EXPERT_CASES)
def test_expert_groups_match_naive_megatron_enumeration(world, tp, pp, ep, etp, mapping):
    layout = derive_layout(world, tp=tp, pp=pp, ep=ep, etp=etp, use_tp_pp_dp_mapping=mapping)
    names, sizes = layout.expert_dims()
    expected = naive_expert_groups(world, etp or tp, ep, pp, mapping)
    for dim in ("etp", "ep", "edp", "pp"):
        assert rank_groups(names, sizes, dim) == expected[dim], dim
    # Megatron asserts the pipeline groups of both generators coincide
    assert rank_groups(names, sizes, "pp") == rank_groups(*layout.dense_dims(), "pp")


@pytest.mark.megatron
def test_groups_match_megatron_core_rank_generator():
    import megatron.core.parallel_state as ps  # the oracle: CI installs it
    for world, tp, cp, pp, dpr, mapping in DENSE_CASES:
        layout = derive_layout(world, tp=tp, cp=cp, pp=pp, dp_replicate=dpr, use_tp_pp_dp_mapping=mapping)
        order = "tp-cp-ep-pp-dp" if mapping else "tp-cp-ep-dp-pp"
        gen = ps.RankGenerator(tp=tp, ep=1, dp=layout.dp, pp=pp, cp=cp, order=order)
        names, sizes = layout.dense_dims()
        for ours, theirs in [("tp", "tp"), ("cp", "cp"), ("pp", "pp"), (FLATTENED_DIMS["dp"], "dp"),
                             (FLATTENED_DIMS["dp_cp"], "dp-cp"), (FLATTENED_DIMS["mp"], "tp-pp")]:
            assert rank_groups(names, sizes, ours) == sorted(gen.get_ranks(theirs)), (world, tp, cp, pp, theirs)
    for world, tp, pp, ep, etp, mapping in EXPERT_CASES:
        layout = derive_layout(world, tp=tp, pp=pp, ep=ep, etp=etp, use_tp_pp_dp_mapping=mapping)
        order = "tp-cp-ep-pp-dp" if mapping else "tp-cp-ep-dp-pp"
        gen = ps.RankGenerator(tp=layout.etp, ep=ep, dp=layout.edp, pp=pp, cp=1, order=order)
        names, sizes = layout.expert_dims()
        for ours, theirs in [("etp", "tp"), ("ep", "ep"), ("edp", "dp"), ("pp", "pp")]:
            assert rank_groups(names, sizes, ours) == sorted(gen.get_ranks(theirs)), (world, ep, etp, theirs)


def test_hybrid_shard_groups_match_megatron_partial_data_parallel_groups():
    # Megatron's intra-partial dp groups (num_distributed_optimizer_instances=R) are consecutive chunks of the
    # dp-cp group: that is our dp_shard_cp; the replicas are the strided rest.
    layout = derive_layout(16, tp=2, cp=2, dp_replicate=2)
    names, sizes = layout.dense_dims()
    dp_cp = rank_groups(names, sizes, FLATTENED_DIMS["dp_cp"])
    chunk = layout.dp_shard * layout.cp
    expected = sorted((g[i:i + chunk] for g in dp_cp for i in range(0, len(g), chunk)), key=lambda g: g[0])
    assert rank_groups(names, sizes, FLATTENED_DIMS["dp_shard_cp"]) == expected


def test_expert_mesh_only_when_needed():
    assert not derive_layout(8, tp=2).has_expert_mesh
    assert derive_layout(8, tp=2, ep=2).has_expert_mesh
    assert derive_layout(8, tp=2, etp=1).has_expert_mesh
    assert derive_layout(8, tp=2, cp=2).edp == 4  # edp = world / (etp*ep*pp) includes cp, like Megatron


# --------------------------------------------------------------------------- errors


def test_world_not_divisible_names_the_sizes():
    with pytest.raises(LaunchError) as exc:
        derive_layout(6, tp=4)
    assert str(exc.value).startswith(
        "world size 6 is not divisible by tensor_model_parallel_size (4) × pipeline_model_parallel_size (1) × "
        "context_parallel_size (1) = 4")
    assert "\n" not in str(exc.value)


def test_expert_sizes_not_dividing_world():
    with pytest.raises(LaunchError, match=r"expert_tensor_parallel_size \(1\) × expert_model_parallel_size \(3\)"):
        derive_layout(4, tp=1, ep=3)


def test_dp_replicate_must_divide_dp():
    with pytest.raises(ConfigError, match="data parallel size 4 is not divisible"):
        derive_layout(8, tp=2, dp_replicate=3)


@pytest.mark.parametrize("field,value", [("tensor_model_parallel_size", 0), ("pipeline_model_parallel_size", -1),
                                         ("context_parallel_size", 1.5)])
def test_non_positive_sizes(field, value):
    cfg = SimpleNamespace(**{field: value})
    with pytest.raises(ConfigError, match=field):
        check_layout(4, cfg)


def test_check_layout_heads_and_query_groups():
    ok = SimpleNamespace(tensor_model_parallel_size=2, num_attention_heads=8, num_query_groups=2)
    check_layout(4, ok)
    check_layout(4, SimpleNamespace(tensor_model_parallel_size=2, num_attention_heads=8, num_query_groups=None))
    bad_heads = SimpleNamespace(tensor_model_parallel_size=4, num_attention_heads=6, num_query_groups=None)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=4 must divide model.num_attention_heads=6 "
                                          "and model.num_query_groups"):
        check_layout(4, bad_heads)
    bad_groups = SimpleNamespace(tensor_model_parallel_size=4, num_attention_heads=8, num_query_groups=2)
    with pytest.raises(ConfigError, match="num_query_groups=2"):
        check_layout(4, bad_groups)


def test_check_layout_world_size_error_before_heads():
    cfg = SimpleNamespace(tensor_model_parallel_size=4, pipeline_model_parallel_size=1, num_attention_heads=8)
    with pytest.raises(LaunchError, match="world size 6 is not divisible"):
        check_layout(6, cfg)


def test_check_layout_with_real_model_parallel_config():
    from longspan.core.model_parallel_config import ModelParallelConfig

    cfg = ModelParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    check_layout(8, cfg)
    with pytest.raises(LaunchError, match="= 4"):
        check_layout(6, cfg)


def test_virtual_pipeline_needs_pipeline():
    with pytest.raises(ConfigError, match="virtual_pipeline_model_parallel_size=2"):
        check_layout(2, SimpleNamespace(virtual_pipeline_model_parallel_size=2))


def test_tp_pp_dp_mapping_with_experts_and_pipeline_needs_equal_dp():
    with pytest.raises(ConfigError, match="use_tp_pp_dp_mapping"):
        derive_layout(8, tp=1, pp=2, ep=2, use_tp_pp_dp_mapping=True)
    with pytest.raises(ConfigError, match="use_tp_pp_dp_mapping"):  # cp > 1 too, as Megatron asserts
        derive_layout(16, tp=2, cp=2, pp=2, use_tp_pp_dp_mapping=True)
