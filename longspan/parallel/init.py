"""Distributed initialization: detect the launch, create the process group and the device mesh.

Three launches are recognised, in this order (``detect_launch``):

1. torchrun / torch elastic (``longspan pretrain --nproc-per-node``, plain torchrun): ``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK`` are set; the rendezvous is ``env://`` (``MASTER_ADDR``/``MASTER_PORT``).
2. SLURM (``srun python -m longspan ...``): ``SLURM_PROCID``, ``SLURM_NTASKS`` (``SLURM_STEP_NUM_TASKS`` when
   srun sets it), ``SLURM_LOCALID``. The master address is ``MASTER_ADDR`` if the user exported one, else the
   first host of the step's node list (``scontrol show hostnames`` when available, else parsed here) — rank 0
   runs there under SLURM's block distribution — else ``SLURM_LAUNCH_NODE_IPADDR``. The port is
   ``MASTER_PORT`` or ``15000 + last four digits of SLURM_JOB_ID`` (the same on every task of the job).
3. anything else: one process. No process group is created when the world size is 1, whatever the launcher.

Only one rank should print a configuration error under plain torchrun/srun: catch ``LongspanError`` and return
``report_user_error_once(exc)`` (rank 0 prints one line, every rank exits with code 2).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from longspan.core.errors import ConfigError, LaunchError, LongspanError
from longspan.core.logging import get_logger
from longspan.parallel.mesh import Layout, ParallelMeshes, build_device_mesh, layout_from_config
from longspan.parallel.nccl_options import (
    clear_collnet_environment,
    nccl_group_options,
    sharp_applies,
    start_sharp_communicator,
)
from datetime import timedelta
from longspan.core.logging import get_rank

if TYPE_CHECKING:
    from longspan.config.schema.infra import DistributedInitConfig
    from longspan.core.model_parallel_config import ModelParallelConfig

_log = get_logger(__name__)


# --------------------------------------------------------------------------------------------- launch detection

@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process: who it is and where rank 0 listens."""

    kind: str  #: "torchrun", "slurm" or "single"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None


def _int_env(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise LaunchError(f"environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"environment variable {name}={raw!r} is not an integer") from None


def first_host_of_nodelist(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[03-05,09],cpu1"`` -> ``"gpu03"`` (no scontrol needed)."""
    nodelist = nodelist.strip()
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # first top-level comma ends the first entry
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    entry = nodelist[:end]
    if "[" not in entry:
        return entry
    prefix, rest = entry.split("[", 1)
    ranges, suffix = rest.split("]", 1)
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


def _scontrol_first_host(nodelist: str) -> str | None:
    if shutil.which("scontrol") is None:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def slurm_master_port(job_id: str | None) -> int:
    """Default rendezvous port of a SLURM job: 15000 + the last four digits of the job id (29500 without one)."""
    if not job_id:
        return 29500
    digits = "".join(ch for ch in job_id if ch.isdigit())
    return 15000 + int(digits[-4:] or 0)


def detect_launch(env: Mapping[str, str] | None = None,
                  hostnames_fn: Callable[[str], str | None] | None = None) -> LaunchEnv:
    """Detect torchrun, SLURM or a single process from ``env`` (default ``os.environ``). Pure apart from
    ``hostnames_fn`` (default: ``scontrol show hostnames``), which maps a node list to its first host."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int_env(env, "WORLD_SIZE")
        rank = _int_env(env, "RANK")
        local_rank = _int_env(env, "LOCAL_RANK", 0)
        if world < 1 or not 0 <= rank < world:
            raise LaunchError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
        if world == 1:
            return LaunchEnv("single", 0, 1, local_rank)
        port = env.get("MASTER_PORT")
        return LaunchEnv("torchrun", rank, world, local_rank, env.get("MASTER_ADDR"),
                         int(port) if port else None)
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        world = _int_env(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")
        rank = _int_env(env, "SLURM_PROCID")
        local_rank = _int_env(env, "SLURM_LOCALID", 0)
        if world < 1 or not 0 <= rank < world:
            raise LaunchError(f"SLURM_PROCID={rank} is not in [0, SLURM_NTASKS={world})")
        if world == 1:
            return LaunchEnv("single", 0, 1, local_rank)
        addr = env.get("MASTER_ADDR")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not addr and nodelist:
            addr = (hostnames_fn or _scontrol_first_host)(nodelist) or first_host_of_nodelist(nodelist)
        if not addr:
            addr = env.get("SLURM_LAUNCH_NODE_IPADDR")
        if not addr:
            raise LaunchError("SLURM launch without SLURM_NODELIST or SLURM_LAUNCH_NODE_IPADDR: export "
                              "MASTER_ADDR=<host of rank 0> (and optionally MASTER_PORT)")
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else slurm_master_port(env.get("SLURM_JOB_ID"))
        return LaunchEnv("slurm", rank, world, local_rank, addr, port)
    return LaunchEnv("single", 0, 1, _int_env(env, "LOCAL_RANK", 0))


# --------------------------------------------------------------------------------------------- parallel state

@dataclass
class ParallelState:
    """Who this process is in every parallel dimension, and the groups to talk to the others.

    On one process ``mesh`` is ``None``, every group is ``None`` and every size is 1 (the collectives in
    ``longspan.parallel.collectives`` are no-ops then). Dimension names: ``tp``, ``cp``, ``pp``, ``dp``,
    ``dp_replicate``, ``dp_shard``, ``dp_cp``, ``dp_shard_cp``, ``mp`` (pp × tp), ``ep``, ``etp``, ``edp``.
    """

    world_size: int
    rank: int
    local_rank: int
    device: Any  #: torch.device of this rank (cuda:N or cpu)
    backend: str | None  #: "nccl" or "gloo" (None on one process)
    layout: Layout
    launch: LaunchEnv = field(default_factory=lambda: LaunchEnv("single"))
    meshes: ParallelMeshes | None = None
    #: process groups made on demand in this world (the pipeline's embedding groups), keyed by purpose and
    #: ranks; ``destroy_distributed`` empties it: a group must not outlive its world (in-process restart)
    extra_groups: dict[tuple, Any] = field(default_factory=dict, repr=False, compare=False)

    # -- generic accessors
    @property
    def mesh(self) -> Any:
        """The dense DeviceMesh ``(pp, dp_replicate, dp_shard, cp, tp)`` (None on one process)."""
        return None if self.meshes is None else self.meshes.mesh

    @property
    def expert_mesh(self) -> Any:
        """The expert DeviceMesh ``(pp, edp, ep, etp)``, or None when ep == 1 and etp == tp."""
        return None if self.meshes is None else self.meshes.expert_mesh

    def submesh(self, dim: str) -> Any:
        """The 1-D DeviceMesh of ``dim`` (dense, flattened or expert; see the class docstring)."""
        if self.meshes is None:
            return None
        if dim in ("ep", "etp", "edp") and self.meshes.expert_mesh is None:
            dim = {"ep": None, "etp": "tp", "edp": "dp_cp"}[dim]
            if dim is None:
                return None
        return self.meshes[dim]

    def size(self, dim: str) -> int:
        """Number of ranks in this rank's ``dim`` group."""
        lay = self.layout
        sizes = {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp, "dp_replicate": lay.dp_replicate,
                 "dp_shard": lay.dp_shard, "dp_cp": lay.dp * lay.cp, "dp_shard_cp": lay.dp_shard * lay.cp,
                 "mp": lay.pp * lay.tp, "ep": lay.ep, "etp": lay.etp, "edp": lay.edp}
        return sizes[dim]

    def rank_in(self, dim: str) -> int:
        """This rank's index within its ``dim`` group."""
        sub = self.submesh(dim)
        return 0 if sub is None else sub.get_local_rank()

    def group(self, dim: str) -> Any:
        """The ProcessGroup of ``dim`` containing this rank (None on one process or for a missing ep dim)."""
        sub = self.submesh(dim)
        return None if sub is None else sub.get_group()

    # -- named accessors (Megatron's vocabulary)
    tp_size = property(lambda self: self.size("tp"), doc="tensor-parallel size")
    tp_rank = property(lambda self: self.rank_in("tp"), doc="tensor-parallel rank")
    tp_group = property(lambda self: self.group("tp"), doc="tensor-parallel group")
    cp_size = property(lambda self: self.size("cp"), doc="context-parallel size")
    cp_rank = property(lambda self: self.rank_in("cp"), doc="context-parallel rank")
    cp_group = property(lambda self: self.group("cp"), doc="context-parallel group")
    pp_size = property(lambda self: self.size("pp"), doc="pipeline-parallel size")
    pp_rank = property(lambda self: self.rank_in("pp"), doc="pipeline stage of this rank")
    pp_group = property(lambda self: self.group("pp"), doc="pipeline-parallel group")
    dp_size = property(lambda self: self.size("dp"), doc="data-parallel size (replicate × shard)")
    dp_rank = property(lambda self: self.rank_in("dp"), doc="data-parallel rank (picks the batch slice)")
    dp_group = property(lambda self: self.group("dp"), doc="data-parallel group (without cp)")
    dp_cp_group = property(lambda self: self.group("dp_cp"), doc="dp × cp group (gradient reduction)")
    dp_replicate_size = property(lambda self: self.size("dp_replicate"), doc="hybrid-sharding replicas")
    dp_shard_size = property(lambda self: self.size("dp_shard"), doc="ranks sharding within a replica")
    mp_group = property(lambda self: self.group("mp"), doc="model-parallel group: tp × pp, as Megatron's")
    ep_size = property(lambda self: self.size("ep"), doc="expert-parallel size")
    ep_rank = property(lambda self: self.rank_in("ep"), doc="expert-parallel rank")
    ep_group = property(lambda self: self.group("ep"), doc="expert-parallel group (None when ep == 1)")
    etp_size = property(lambda self: self.size("etp"), doc="expert tensor-parallel size")
    etp_group = property(lambda self: self.group("etp"), doc="expert tensor-parallel group")
    edp_size = property(lambda self: self.size("edp"), doc="expert data-parallel size")
    edp_group = property(lambda self: self.group("edp"), doc="expert data-parallel group")

    @property
    def is_rank_0(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        """The last global rank: Megatron's training-log rank."""
        return self.rank == self.world_size - 1

    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_STATE: ParallelState | None = None


def get_parallel_state() -> ParallelState:
    """The state set by ``initialize_distributed`` (RuntimeError before it ran)."""
    if _STATE is None:
        raise RuntimeError("longspan.parallel.init.initialize_distributed() has not been called")
    return _STATE


def is_initialized() -> bool:
    """Whether ``initialize_distributed`` has run in this process (and not been torn down)."""
    return _STATE is not None


#: callbacks that drop module-level references to process groups of the world being torn down
_TEARDOWN_HOOKS: list[Callable[[], None]] = []


def on_destroy_distributed(hook: Callable[[], None]) -> Callable[[], None]:
    """Register ``hook`` to run in ``destroy_distributed`` (a module that keeps a process group of its own, e.g.
    the background checkpoint group, forgets it there); returns ``hook``."""
    if hook not in _TEARDOWN_HOOKS:
        _TEARDOWN_HOOKS.append(hook)
    return hook


def _clear_dtensor_caches() -> None:
    """Empty torch's DTensor caches that hold device meshes (sharding propagation, redistribution plans, mesh
    topology). A destroyed group stays alive while anything references its mesh: every gloo group keeps three
    native threads and its sockets, so each world created in one process (in-process restarts, a test worker)
    would pile them up. The caches refill on the next DTensor operation."""
    if "torch.distributed.tensor" not in sys.modules:
        return  # no DTensor was ever made in this process
    # torch on first use, as in destroy_distributed
    import torch
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo

    propagator = DTensor._op_dispatcher.sharding_propagator
    for clear in (
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),  # the C++ dispatch fast path
        getattr(propagator.propagate_op_sharding, "cache_clear", None),
        getattr(getattr(type(propagator), "_propagate_tensor_meta_cached", None), "cache_clear", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(MeshTopoInfo.build_from_mesh, "cache_clear", None),
    ):
        if clear is not None:
            with contextlib.suppress(Exception):  # private torch caches: a missing or changed one is no error
                clear()


def destroy_distributed() -> None:
    """Tear down the process group (if any) and forget the parallel state and the groups made in it.

    The groups' native threads and sockets are released here, not at some later garbage collection: torch's
    DTensor caches are emptied, the registered teardown hooks run, and reference cycles (modules, optimizers)
    that still hold meshes are collected."""
    global _STATE
    if _STATE is not None:
        _STATE.extra_groups.clear()  # a caller may still hold the state (GlobalState.parallel)
    _STATE = None
    # torch on first use: the launcher and the supervisor import this module without torch (start-up time)
    import torch.distributed as dist

    for hook in _TEARDOWN_HOOKS:
        hook()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _clear_dtensor_caches()
    for _ in range(3):  # FSDP2's state is freed in a second pass (weakref callbacks of the first make garbage)
        if not gc.collect():
            break


# --------------------------------------------------------------------------------------------- initialization

def _check_supported(dist_cfg: DistributedInitConfig) -> None:
    """Reject DistributedInitConfig values this version cannot honour (one line each)."""
    backend = dist_cfg.distributed_backend
    if backend not in ("nccl", "gloo"):
        raise ConfigError(f"dist.distributed_backend={backend!r} is not valid; use 'nccl' or 'gloo'")
    timeout = dist_cfg.distributed_timeout_minutes
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"dist.distributed_timeout_minutes={timeout!r} must be a positive number of minutes")


def _resolve_device(dist_cfg: DistributedInitConfig, device: Any, local_rank: int) -> Any:
    # torch on first use: the launcher and the supervisor import this module without torch (start-up time)
    import torch

    if device is not None:
        dev = torch.device(device)
    elif torch.cuda.is_available():
        dev = torch.device("cuda")
    else:
        dev = torch.device("cpu")
    if dev.type == "cuda":
        index = dev.index
        if index is None:
            index = 0 if dist_cfg.external_gpu_device_mapping else local_rank
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise LaunchError(
                f"local rank {local_rank} needs CUDA device {index} but only {count} are visible; start at most "
                f"{count} processes per node or set dist.external_gpu_device_mapping=True when the launcher "
                "already restricts CUDA_VISIBLE_DEVICES to one GPU per process")
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
    return dev


def pipeline_group_backend(value: str | None, device: Any, ucc_available: bool) -> str | None:
    """The backend of the pipeline group for ``model.pipeline_model_parallel_comm_backend`` (None: the default
    process group's). 'nccl' needs CUDA devices: elsewhere the default backend serves (start-up lists the
    field as not applicable); 'ucc' needs a torch build with UCC."""
    if value is None or (value == "nccl" and device.type != "cuda"):
        return None
    if value == "ucc" and not ucc_available:
        raise ConfigError(
            "model.pipeline_model_parallel_comm_backend='ucc' needs a torch build with UCC "
            "(torch.distributed.is_ucc_available() is False here): use None or 'nccl'")
    return value


def initialize_distributed(
    dist_cfg: DistributedInitConfig,
    model_parallel_cfg: ModelParallelConfig,
    *,
    device: Any = None,
    dp_replicate: int = 1,
    env: Mapping[str, str] | None = None,
) -> ParallelState:
    """Detect the launch, create the process group and the device mesh; return (and remember) the state.

    ``dist_cfg`` is a DistributedInitConfig (fields read: distributed_backend, distributed_timeout_minutes,
    use_gloo_process_groups, external_gpu_device_mapping, local_rank, use_tp_pp_dp_mapping, use_sharp,
    high_priority_stream_groups and nccl_communicator_config_path (NCCL group options on CUDA)).
    ``model_parallel_cfg`` is a ModelParallelConfig (or a provider inheriting it).
    ``device`` forces the device ("cpu", "cuda", "cuda:1"); default cuda when available, else cpu.
    ``dp_replicate`` splits data parallel into replicas × shards for hybrid sharding (the data-parallel code
    passes ``ddp.num_distributed_optimizer_instances`` or its hybrid-sharding degree).

    Backend: ``nccl`` on GPUs; a CPU run that asks for nccl uses gloo and logs one warning on rank 0. With
    nccl and ``use_gloo_process_groups`` (default True) the process group is ``cpu:gloo,cuda:nccl``, so every
    group (mesh groups included) also handles CPU tensors over gloo. CUDA device: the local rank, or device 0
    with ``external_gpu_device_mapping``. World size 1: no process group, no mesh.

    Always initializes at once: ``dist.lazy_init`` (Megatron's deferred initialization for an external DDP
    manager) is the contract of ``prepare_distributed``, whose finisher ``initialize_megatron`` returns.
    """
    return prepare_distributed(dist_cfg, model_parallel_cfg, device=device, dp_replicate=dp_replicate, env=env)()


def prepare_distributed(
    dist_cfg: DistributedInitConfig,
    model_parallel_cfg: ModelParallelConfig,
    *,
    device: Any = None,
    dp_replicate: int = 1,
    env: Mapping[str, str] | None = None,
) -> Callable[[], ParallelState]:
    """Everything of ``initialize_distributed`` but the process groups; returns the finisher that creates them.

    Checked and resolved now: the config, the launch, the parallel layout (a world size the layout does not
    fit fails here), this rank's device (``torch.cuda.set_device``). The finisher creates the default process
    group (or adopts one an external manager created) and the device meshes, remembers the state
    (``get_parallel_state``) and returns it; a second call returns the same state while it is current.
    Nothing is global before the finisher runs: ``is_initialized()`` stays False (Megatron's ``lazy_mpu_init``).
    """
    _check_supported(dist_cfg)
    launch = detect_launch(env)
    use_mapping = bool(dist_cfg.use_tp_pp_dp_mapping)
    layout = layout_from_config(launch.world_size, model_parallel_cfg, dp_replicate=dp_replicate,
                                use_tp_pp_dp_mapping=use_mapping)
    local_rank = launch.local_rank
    if launch.kind == "single":
        local_rank = int(dist_cfg.local_rank or 0)
    dev = _resolve_device(dist_cfg, device, local_rank)

    backend = dist_cfg.distributed_backend
    if backend == "nccl" and dev.type != "cuda":
        # nccl is the default: on a CPU machine it adapts silently (the banner says "device cpu").
        _log.debug("dist.distributed_backend='nccl' needs CUDA devices; this run is on CPU, using gloo")
        backend = "gloo"
    made: list[ParallelState] = []

    def finish() -> ParallelState:
        if made and _STATE is made[0]:
            return made[0]
        made[:] = [_create_groups(dist_cfg, model_parallel_cfg, launch, layout, local_rank, dev, backend)]
        return made[0]

    return finish


def _create_groups(dist_cfg: DistributedInitConfig, model_parallel_cfg: ModelParallelConfig, launch: LaunchEnv,
                   layout: Layout, local_rank: int, dev: Any, backend: str) -> ParallelState:
    """The default process group and the device meshes of a prepared launch; sets the module's state."""
    global _STATE
    if launch.world_size == 1:
        _STATE = ParallelState(world_size=1, rank=0, local_rank=local_rank, device=dev, backend=None,
                               layout=layout, launch=launch)
        return _STATE

    # torch on first use: the launcher and the supervisor import this module without torch (start-up time)
    import torch.distributed as dist

    sharp = sharp_applies(dist_cfg, backend, dev)
    if sharp:
        # NCCL gives SHARP (CollNet) to the first communicator created with it enabled: none before dp's
        clear_collnet_environment()
    _init_process_group(dist_cfg, launch, backend, dev, eager_nccl=not sharp)
    # per-group NCCL options: NCCL groups only (a CPU run lists the fields as not applicable at start-up)
    group_options = nccl_group_options(dist_cfg) if backend == "nccl" and dev.type == "cuda" else {}
    pp_backend = pipeline_group_backend(model_parallel_cfg.pipeline_model_parallel_comm_backend,
                                        dev, dist.is_ucc_available())
    meshes = build_device_mesh(
        launch.world_size, tp=layout.tp, cp=layout.cp, pp=layout.pp, dp_replicate=layout.dp_replicate,
        ep=layout.ep, etp=layout.etp, use_tp_pp_dp_mapping=bool(dist_cfg.use_tp_pp_dp_mapping),
        device_type="cuda" if dev.type == "cuda" else "cpu", group_options=group_options,
        group_backends={"pp": pp_backend},
    )
    if sharp:
        start_sharp_communicator(meshes["dp_cp"].get_group(), dev)
        if launch.rank == 0:
            _log.info("dist.use_sharp: the data-parallel (dp x cp) communicator uses SHARP (NCCL CollNet); the "
                      "others do not (NCCL_COLLNET_ENABLE stays unset)")
    _STATE = ParallelState(world_size=launch.world_size, rank=launch.rank, local_rank=local_rank, device=dev,
                           backend=backend, layout=layout, launch=launch, meshes=meshes)
    return _STATE


def _init_process_group(dist_cfg: DistributedInitConfig, launch: Any, backend: str, dev: Any,
                        eager_nccl: bool = True) -> None:
    """The default process group for this launch (or a check of the one that already exists)."""
    # torch on first use: the launcher and the supervisor import this module without torch (start-up time)
    import torch.distributed as dist

    timeout = timedelta(minutes=float(dist_cfg.distributed_timeout_minutes))
    pg_backend = backend
    if backend == "nccl" and dist_cfg.use_gloo_process_groups:
        pg_backend = "cpu:gloo,cuda:nccl"
    if dist.is_initialized():
        if dist.get_world_size() != launch.world_size:
            raise LaunchError(f"a process group of {dist.get_world_size()} ranks already exists but the launcher "
                              f"says WORLD_SIZE={launch.world_size}")
        return
    kwargs: dict[str, Any] = {"backend": pg_backend, "timeout": timeout, "rank": launch.rank,
                              "world_size": launch.world_size}
    if launch.kind == "slurm":
        kwargs["init_method"] = f"tcp://{launch.master_addr}:{launch.master_port}"
    else:
        kwargs["init_method"] = "env://"
    if dev.type == "cuda" and pg_backend == "nccl" and eager_nccl:
        # eager NCCL init lets DeviceMesh create its groups with ncclCommSplit; not with the mixed
        # cpu:gloo,cuda:nccl backend, whose gloo half may not support splitting, nor with SHARP, whose
        # data-parallel communicator must be created first (start_sharp_communicator)
        kwargs["device_id"] = dev
    dist.init_process_group(**kwargs)


# --------------------------------------------------------------------------------------------- user errors

def report_user_error_once(exc: LongspanError, *, all_ranks: bool = False, stream: Any = None) -> int:
    """Print ``exc`` as the CLI's one line (``longspan: error: ...``) on rank 0 only; return its exit code.

    Every rank of a torchrun/srun job validates the same configuration and hits the same error; printing it
    N times buries it. Non-zero ranks stay silent and still exit with the same code (2). Pass
    ``all_ranks=True`` for errors that may differ per rank (a data file missing on one node): each rank then
    prints its line prefixed with ``[rank R]``. The rank comes from torch.distributed when initialized, else
    from the launcher's environment, so it works before the process group exists.
    """
    stream = stream or sys.stderr
    rank = get_rank()
    if rank == 0 and not all_ranks:
        stream.write(f"longspan: error: {exc}\n")
    elif all_ranks:
        stream.write(f"[rank {rank}] longspan: error: {exc}\n")
    stream.flush()
    return int(getattr(exc, "exit_code", 2))
