"""Rules of the data-parallel sharding fields: Megatron-FSDP's ``ddp.data_parallel_sharding_strategy`` mapped onto
longspan's modes, and the hybrid sharding of ``ddp.num_distributed_optimizer_instances``.

Part of ``ConfigContainer.validate()`` (``validate.py``); every failure is one ``ConfigError`` line.

Megatron-FSDP's strategies are ZeRO stages; longspan runs them on PyTorch FSDP2 (``longspan.parallel.data_parallel``):

- ``no_shard``: nothing sharded (DDP, the default);
- ``optim`` and ``optim_grads``: the distributed optimizer (``optimizer.use_distributed_optimizer``): optimizer
  state and gradients sharded, parameters whole between forward and backward. ZeRO-1 keeps whole gradients
  where longspan reduce-scatters them: the same update, less memory;
- ``optim_grads_params``: FSDP2 (``dist.use_torch_fsdp2``), parameters sharded too (ZeRO-3).

``ddp.use_megatron_fsdp`` (its deprecated name ``ddp.use_custom_fsdp``, Bridge's newer ``dist.use_megatron_fsdp``)
asks for Megatron-FSDP itself: PyTorch FSDP2 runs in its place (``longspan.parallel.data_parallel.data_parallel_mode``),
with Megatron Bridge's contract:
the distributed optimizer is always on, the strategy picks what is sharded, and dist.use_torch_fsdp2,
dist.use_tp_pp_dp_mapping and (with 'optim_grads_params') train.check_weight_hash_across_dp_replicas_interval are
rejected with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from longspan.core.errors import ConfigError
from longspan.core.logging import get_logger, print_rank_0

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer

logger = get_logger(__name__)

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def megatron_fsdp_field(ddp: Any) -> str | None:
    """``"ddp.use_megatron_fsdp"`` or ``"ddp.use_custom_fsdp"`` (its deprecated name) when either is set, else None."""
    for name in ("use_megatron_fsdp", "use_custom_fsdp"):
        if getattr(ddp, name, False):
            return f"ddp.{name}"
    return None


def apply_megatron_fsdp(cfg: "ConfigContainer") -> None:
    """Megatron-FSDP requested: FSDP2 runs in its place (one notice); Bridge's conflicts are one-line errors.

    Bridge's current key is ``dist.use_megatron_fsdp`` and it sets ``ddp.use_megatron_fsdp`` from either (and
    the dist one from the ddp one), so both end up True here too."""
    field = megatron_fsdp_field(cfg.ddp)
    if cfg.dist.use_megatron_fsdp:
        field = field or "dist.use_megatron_fsdp"
    if field is None:
        return
    cfg.ddp.use_megatron_fsdp = cfg.dist.use_megatron_fsdp = True
    strategy = cfg.ddp.data_parallel_sharding_strategy
    if cfg.dist.use_torch_fsdp2:
        raise ConfigError(f"{field}=True and dist.use_torch_fsdp2=True are mutually exclusive (Megatron-FSDP or "
                          "PyTorch FSDP2): set one of them")
    if cfg.dist.use_tp_pp_dp_mapping:
        raise ConfigError(f"{field}=True does not support dist.use_tp_pp_dp_mapping=True: set one of them")
    interval = cfg.train.check_weight_hash_across_dp_replicas_interval
    if strategy == "optim_grads_params" and interval is not None:
        raise ConfigError(f"{field}=True with ddp.data_parallel_sharding_strategy='optim_grads_params' does not support "
                          f"train.check_weight_hash_across_dp_replicas_interval={interval}: set it to null")
    if not (cfg.optimizer.use_distributed_optimizer and cfg.ddp.use_distributed_optimizer):
        cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = True
        print_rank_0(f"{field}=True always uses the distributed optimizer: optimizer.use_distributed_optimizer set "
                     "to True", logger)
    sharded = "parameters, gradients and optimizer state" if strategy == "optim_grads_params" else \
        "gradients and optimizer state"
    deprecated = " (use_custom_fsdp is the deprecated name of use_megatron_fsdp)" if field.endswith("custom_fsdp") else ""
    print_rank_0(f"{field}=True: PyTorch FSDP2 runs in Megatron-FSDP's place, sharding {sharded} "
                 f"(ddp.data_parallel_sharding_strategy={strategy!r}){deprecated}", logger)


def apply_sharding_strategy(cfg: "ConfigContainer") -> None:
    """A sharding strategy other than 'no_shard' switches on the longspan mode that shards the same state."""
    strategy = cfg.ddp.data_parallel_sharding_strategy
    if strategy not in STRATEGIES:
        raise ConfigError(f"ddp.data_parallel_sharding_strategy={strategy!r} is not valid: use one of {STRATEGIES}")
    if strategy == "no_shard":
        return
    field = f"ddp.data_parallel_sharding_strategy={strategy!r}"
    if megatron_fsdp_field(cfg.ddp) is not None:
        return  # Megatron-FSDP reads the strategy itself (data_parallel_mode); apply_megatron_fsdp checked it
    if strategy == "optim_grads_params":
        if not cfg.dist.use_torch_fsdp2:
            cfg.dist.use_torch_fsdp2 = True
            print_rank_0(f"{field} shards parameters too: dist.use_torch_fsdp2 set to True (PyTorch FSDP2)", logger)
        return
    if cfg.dist.use_torch_fsdp2:
        raise ConfigError(
            f"{field} keeps the parameters whole but dist.use_torch_fsdp2=True shards them (that is "
            "'optim_grads_params'): set one of them"
        )
    if not cfg.optimizer.use_distributed_optimizer:
        cfg.optimizer.use_distributed_optimizer = True
        print_rank_0(f"{field} shards the optimizer state: optimizer.use_distributed_optimizer set to True", logger)


def sync_param_gather_switches(cfg: "ConfigContainer") -> None:
    """Switches Megatron sets from one argument, kept equal: ``optimizer.overlap_param_gather`` with
    ``ddp.overlap_param_gather`` (the one FSDP2's prefetch reads), ``ddp.fp8_param_gather`` with
    ``model.fp8_param`` (the one the float8 all-gather reads)."""
    opt, ddp = cfg.optimizer, cfg.ddp
    if opt.overlap_param_gather != ddp.overlap_param_gather:
        source = "optimizer" if opt.overlap_param_gather else "ddp"
        opt.overlap_param_gather = ddp.overlap_param_gather = True
        print_rank_0(f"{source}.overlap_param_gather=True: set on both optimizer and ddp (one switch in Megatron)",
                     logger)
    if ddp.fp8_param_gather and not cfg.model.fp8_param:
        if not hasattr(cfg.model, "fp8_param"):
            raise ConfigError(f"ddp.fp8_param_gather=True needs a model with FP8 parameters; "
                              f"{type(cfg.model).__name__} has none: set ddp.fp8_param_gather=false")
        cfg.model.fp8_param = True
        print_rank_0("ddp.fp8_param_gather=True: model.fp8_param set to True (FSDP2 all-gathers float8 weights)",
                     logger)


def check_distributed_optimizer_instances(cfg: "ConfigContainer", data_parallel_size: int) -> None:
    """More than one instance shards within each of that many replicas (HSDP): a sharded mode, a divisible
    data-parallel size, no context parallel."""
    instances = cfg.ddp.num_distributed_optimizer_instances
    if instances == 1:
        return
    field = f"ddp.num_distributed_optimizer_instances={instances}"
    if not (cfg.dist.use_torch_fsdp2 or cfg.optimizer.use_distributed_optimizer):
        raise ConfigError(f"{field} replicates a sharded optimizer: it needs optimizer.use_distributed_optimizer=true "
                          "or dist.use_torch_fsdp2=true")
    if data_parallel_size % instances:
        raise ConfigError(f"{field} does not divide the data-parallel size {data_parallel_size}")
    cp: Any = cfg.model.context_parallel_size or 1
    if cp > 1:
        raise ConfigError(f"{field} (hybrid sharding) with model.context_parallel_size={cp} is not supported yet: "
                          "use one of them")
