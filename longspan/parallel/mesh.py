"""Layout arithmetic and the DeviceMesh that realizes it.

Megatron numbers ranks with tensor parallel fastest, then context parallel, then data parallel, then pipeline
parallel (order ``tp-cp-dp-pp``)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

A row-major DeviceMesh whose dimensions run outermost to innermost reproduces that numbering, so the mesh is
``arange(world).reshape(pp, dp_replicate, dp_shard, cp, tp)`` with dimension names
``("pp", "dp_replicate", "dp_shard", "cp", "tp")``. The data-parallel dimension is always split into
``dp_replicate × dp_shard`` (hybrid sharding: replicas outer, shards inner, matching Megatron's
``num_distributed_optimizer_instances`` partial groups); without hybrid sharding ``dp_replicate`` is 1.
With ``use_tp_pp_dp_mapping`` Megatron's order becomes ``tp-cp-pp-dp`` and the dimensions are
``("dp_replicate", "dp_shard", "pp", "cp", "tp")``.

Flattened dimensions are added to every mesh so that code can ask for any group by name:
``dp`` (dp_replicate × dp_shard), ``dp_cp`` (dp × cp: gradient reduction and FSDP sharding with context
parallel), ``dp_shard_cp`` (the shard part of hybrid sharding including cp) and ``mp`` (pp × tp, Megatron's
model-parallel group, which does not include cp).

Expert dimensions follow Megatron's second rank generator over the same ranks: in the order string the
tensor dimension becomes the expert-tensor dimension, context parallel disappears, expert parallel sits
between tensor and data (``etp-ep-edp-pp``), and the expert data-parallel size is
``world / (etp × ep × pp)``. The expert mesh is a second DeviceMesh ``("pp", "edp", "ep", "etp")`` (or
``("edp", "pp", "ep", "etp")`` with tp-pp-dp mapping) over the same ranks, so the pipeline groups of both
meshes coincide, as Megatron asserts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from longspan.core.errors import ConfigError, LaunchError

#: dimension names of the dense mesh, outermost first, for Megatron's default order (tp-cp-dp-pp)
DENSE_DIMS_DEFAULT = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: dimension names of the dense mesh with ``use_tp_pp_dp_mapping`` (order tp-cp-pp-dp)
DENSE_DIMS_TP_PP_DP = ("dp_replicate", "dp_shard", "pp", "cp", "tp")
#: dimension names of the expert mesh, outermost first (order etp-ep-edp-pp)
EXPERT_DIMS_DEFAULT = ("pp", "edp", "ep", "etp")
#: expert mesh with ``use_tp_pp_dp_mapping`` (order etp-ep-pp-edp)
EXPERT_DIMS_TP_PP_DP = ("edp", "pp", "ep", "etp")
#: flattened dimensions added to the dense mesh: name -> the dense dimensions it joins
FLATTENED_DIMS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "mp": ("pp", "tp"),
}


@dataclass(frozen=True)
class Layout:
    """The sizes of every parallel dimension for one world size (all validated, all ≥ 1)."""

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    dp_replicate: int = 1
    ep: int = 1
    etp: int = 1
    use_tp_pp_dp_mapping: bool = False

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks that shard parameters/optimizer state within one replica."""
        return self.dp // self.dp_replicate

    @property
    def edp(self) -> int:
        """Expert data-parallel size: world / (etp × ep × pp)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def has_expert_mesh(self) -> bool:
        """Whether expert groups differ from the dense ones (otherwise no second mesh is built)."""
        return self.ep > 1 or self.etp != self.tp

    def dense_dims(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Dense mesh dimension names and sizes, outermost first."""
        names = DENSE_DIMS_TP_PP_DP if self.use_tp_pp_dp_mapping else DENSE_DIMS_DEFAULT
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
                 "cp": self.cp, "tp": self.tp}
        return names, tuple(sizes[n] for n in names)

    def expert_dims(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Expert mesh dimension names and sizes, outermost first."""
        names = EXPERT_DIMS_TP_PP_DP if self.use_tp_pp_dp_mapping else EXPERT_DIMS_DEFAULT
        sizes = {"pp": self.pp, "edp": self.edp, "ep": self.ep, "etp": self.etp}
        return names, tuple(sizes[n] for n in names)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def derive_layout(
    world_size: int,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    dp_replicate: int = 1,
    ep: int = 1,
    etp: int | None = None,
    use_tp_pp_dp_mapping: bool = False,
) -> Layout:
    """Validate the sizes against ``world_size`` and derive dp; raises LaunchError/ConfigError (one line)."""
    world_size = _positive_int("world size", world_size)
    tp = _positive_int("tensor_model_parallel_size", tp)
    cp = _positive_int("context_parallel_size", cp)
    pp = _positive_int("pipeline_model_parallel_size", pp)
    ep = _positive_int("expert_model_parallel_size", ep)
    etp = tp if etp is None else _positive_int("expert_tensor_parallel_size", etp)
    dp_replicate = _positive_int("dp_replicate (hybrid sharding replicas)", dp_replicate)
    model = tp * pp * cp
    if world_size % model:
        raise LaunchError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) × "
            f"pipeline_model_parallel_size ({pp}) × context_parallel_size ({cp}) = {model}; use a world size "
            f"that is a multiple of {model} or smaller parallel sizes"
        )
    dp = world_size // model
    expert = etp * ep * pp
    if world_size % expert:
        raise LaunchError(
            f"world size {world_size} is not divisible by expert_tensor_parallel_size ({etp}) × "
            f"expert_model_parallel_size ({ep}) × pipeline_model_parallel_size ({pp}) = {expert}; use a world "
            f"size that is a multiple of {expert} or smaller expert parallel sizes"
        )
    if dp % dp_replicate:
        raise ConfigError(
            f"data parallel size {dp} is not divisible by the number of data-parallel replicas "
            f"(dp_replicate / num_distributed_optimizer_instances = {dp_replicate}); pick a divisor of {dp}"
        )
    if use_tp_pp_dp_mapping and pp > 1 and world_size // expert != dp:
        # Megatron: with pp not last in the order, attention and MoE layers must share the dp size.
        raise ConfigError(
            f"use_tp_pp_dp_mapping=True with pipeline_model_parallel_size {pp} needs the expert data-parallel "
            f"size ({world_size // expert}) to equal the data-parallel size ({dp}); set "
            "use_tp_pp_dp_mapping=False or make etp × ep equal tp × cp"
        )
    return Layout(world_size=world_size, tp=tp, cp=cp, pp=pp, dp=dp, dp_replicate=dp_replicate, ep=ep,
                  etp=etp, use_tp_pp_dp_mapping=use_tp_pp_dp_mapping)


def layout_from_config(
    world_size: int, model_cfg: Any, *, dp_replicate: int = 1, use_tp_pp_dp_mapping: bool = False
) -> Layout:
    """``derive_layout`` with the sizes read from a ModelParallelConfig-like object (missing fields = 1)."""
    def size(name: str) -> Any:
        value = getattr(model_cfg, name, None)
        return 1 if value is None else value

    return derive_layout(
        world_size,
        tp=size("tensor_model_parallel_size"),
        cp=size("context_parallel_size"),
        pp=size("pipeline_model_parallel_size"),
        dp_replicate=dp_replicate,
        ep=size("expert_model_parallel_size"),
        etp=getattr(model_cfg, "expert_tensor_parallel_size", None),  # getattr: any ModelParallelConfig-like object
        use_tp_pp_dp_mapping=use_tp_pp_dp_mapping,
    )


def check_layout(
    world_size: int, model_cfg: Any, *, dp_replicate: int = 1, use_tp_pp_dp_mapping: bool = False
) -> None:
    """Raise LaunchError/ConfigError (one line) if ``model_cfg`` cannot run on ``world_size`` ranks.

    Needs no process group: the launcher and ``longspan config validate --world-size N`` call it before any
    worker starts. Checks the parallel sizes against the world size, and that tensor parallel divides
    ``num_attention_heads`` and ``num_query_groups`` (when the config has them; ``num_query_groups=None``
    means one group per head).
    """
    layout = layout_from_config(world_size, model_cfg, dp_replicate=dp_replicate,
                                use_tp_pp_dp_mapping=use_tp_pp_dp_mapping)
    heads = getattr(model_cfg, "num_attention_heads", None)  # getattr: any ModelParallelConfig-like object
    if heads is not None:
        # start-up time: longspan.config imports torch, which the launcher reads this module without
        from longspan.config.rules.layout import check_tp_divides_heads

        groups = getattr(model_cfg, "num_query_groups", None) or heads  # getattr: as above
        check_tp_divides_heads(layout.tp, heads, groups)
    vp = getattr(model_cfg, "virtual_pipeline_model_parallel_size", None)  # getattr: as above
    if vp is not None and vp > 1 and layout.pp == 1:
        raise ConfigError(
            f"virtual_pipeline_model_parallel_size={vp} needs pipeline_model_parallel_size > 1 (got 1); "
            "unset virtual_pipeline_model_parallel_size or raise pipeline_model_parallel_size"
        )


def rank_grid(names: tuple[str, ...], sizes: tuple[int, ...]) -> Any:
    """``arange(prod(sizes)).reshape(sizes)`` as a torch tensor: the global rank at each mesh coordinate."""
    # torch on first use: the launcher and the supervisor import this module without torch (start-up time)
    import torch

    total = 1
    for s in sizes:
        total *= s
    return torch.arange(total, dtype=torch.int64).reshape(sizes)


def rank_groups(names: tuple[str, ...], sizes: tuple[int, ...], dims: tuple[str, ...] | str) -> list[list[int]]:
    """All rank groups spanning ``dims`` of the mesh ``(names, sizes)``, each group in mesh order.

    For example the tp groups of the default dense layout are ``rank_groups(*layout.dense_dims(), "tp")``.
    Pure: no process group. Groups are sorted by their first rank.
    """
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    grid = rank_grid(names, sizes)
    keep = [names.index(d) for d in dims]
    rest = [i for i in range(len(names)) if i not in keep]
    group_size = 1
    for i in keep:
        group_size *= sizes[i]
    groups = grid.permute(*rest, *keep).reshape(-1, group_size).tolist()
    return sorted(groups, key=lambda g: g[0])


@dataclass
class ParallelMeshes:
    """The meshes of one run: the dense ``mesh``, its flattened sub-meshes, and the optional ``expert_mesh``.

    ``meshes[name]`` returns the 1-D sub-mesh of any dense dimension (``"tp"``, ``"pp"``, ...), flattened
    dimension (``"dp"``, ``"dp_cp"``, ``"dp_shard_cp"``, ``"mp"``) or expert dimension (``"ep"``, ``"etp"``,
    ``"edp"``; only when ``expert_mesh`` exists). Flattened meshes are kept here because torch deprecates
    slicing them from the root mesh.
    """

    layout: Layout
    mesh: Any
    flat: dict[str, Any]
    expert_mesh: Any | None = None

    def __getitem__(self, name: str) -> Any:
        if name in self.flat:
            return self.flat[name]
        if name in self.layout.dense_dims()[0]:
            return self.mesh[name]
        if self.expert_mesh is not None and name in self.layout.expert_dims()[0]:
            return self.expert_mesh[name]
        raise KeyError(f"no mesh dimension {name!r}")


def dim_backend_overrides(dims: tuple[str, ...], options: dict[str, Any],
                          backends: dict[str, str | None]) -> tuple[tuple[str | None, Any], ...] | None:
    """DeviceMesh's ``backend_override``: (backend, options) per dim, None for the default process group's;
    None when no dim overrides anything."""
    entries = tuple((backends.get(d), options.get(d)) for d in dims)
    return entries if any(b is not None or o is not None for b, o in entries) else None


def build_device_mesh(
    world_size: int,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    dp_replicate: int = 1,
    ep: int = 1,
    etp: int | None = None,
    use_tp_pp_dp_mapping: bool = False,
    device_type: str = "cpu",
    group_options: dict[str, Any] | None = None,
    group_backends: dict[str, str | None] | None = None,
) -> ParallelMeshes:
    """Build the dense mesh, its flattened dims and the expert mesh (collective: every rank calls it).

    Needs an initialized default process group of ``world_size`` ranks. The dense mesh has the dimensions
    of ``Layout.dense_dims()``; the flattened ``dp``, ``dp_cp``, ``dp_shard_cp`` and ``mp`` are in
    ``ParallelMeshes.flat``; the expert mesh exists only when ep > 1 or etp != tp (otherwise the expert groups
    equal the dense tp and dp×cp groups). ``group_options`` (dim or flattened name -> process-group options, e.g.
    NCCL's from longspan.parallel.nccl_options) go to the groups of those names, ``group_backends`` (dim ->
    backend name, e.g. {"pp": "ucc"}) make those dims' groups with that backend instead of the default process
    group's. Raises LaunchError/ConfigError when the sizes do not fit.
    """
    # torch on first use: the launcher and the supervisor import this module without torch (start-up time)
    from torch.distributed.device_mesh import DeviceMesh

    layout = derive_layout(world_size, tp=tp, cp=cp, pp=pp, dp_replicate=dp_replicate, ep=ep, etp=etp,
                           use_tp_pp_dp_mapping=use_tp_pp_dp_mapping)
    names, sizes = layout.dense_dims()
    options = group_options or {}
    backends = group_backends or {}

    def overrides(dims: tuple[str, ...]) -> Any:
        return dim_backend_overrides(dims, options, backends)

    mesh = DeviceMesh(device_type, rank_grid(names, sizes), mesh_dim_names=names, backend_override=overrides(names))
    flat = {flat_name: mesh[parts]._flatten(flat_name, backend_override=options.get(flat_name))
            for flat_name, parts in FLATTENED_DIMS.items()}
    expert_mesh = None
    if layout.has_expert_mesh:
        enames, esizes = layout.expert_dims()
        expert_mesh = DeviceMesh(device_type, rank_grid(enames, esizes), mesh_dim_names=enames,
                                 backend_override=overrides(enames))
    return ParallelMeshes(layout=layout, mesh=mesh, flat=flat, expert_mesh=expert_mesh)
