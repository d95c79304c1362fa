"""NCCL process-group options from ``dist.high_priority_stream_groups`` and ``dist.nccl_communicator_config_path``
(Megatron's per-communicator settings): ``ProcessGroupNCCL.Options`` with a high-priority stream and the
communicator's CGA cluster size and CTA bounds, handed to the device meshes' groups (``build_device_mesh``).
Only NCCL groups on CUDA take them; elsewhere start-up lists the fields as not applicable.

``dist.use_sharp`` (SHARP: reductions in the InfiniBand switches, NCCL's CollNet) as megatron-core does it: NCCL
reads ``NCCL_COLLNET_ENABLE`` when a communicator is created and lets only the first communicator created with
it use SHARP, so the variable is cleared before any group exists, set while the data-parallel (dp × cp)
communicator is created by a barrier on it, and cleared again; communicators created later (torch creates them
at a group's first collective) run without CollNet. torch's ``NCCLConfig`` has no CollNet field, so the
environment is the way in, as in Megatron.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

from longspan.config.nccl_groups import nccl_group_settings

if TYPE_CHECKING:
    from longspan.config.schema.infra import DistributedInitConfig


def nccl_group_options(dist_cfg: DistributedInitConfig) -> dict[str, Any]:
    """Group name -> ``ProcessGroupNCCL.Options`` for every group the config names (empty when none)."""
    settings = nccl_group_settings(dist_cfg)
    if not settings:
        return {}
    # torch on first use: parallel.init imports this module in the launcher, which runs without torch
    import torch.distributed as dist

    options = {}
    for name, group in settings.items():
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = bool(group["high_priority"])
        for key in ("cga_cluster_size", "max_ctas", "min_ctas"):
            if key in group:
                setattr(opts.config, key, int(group[key]))
        options[name] = opts
    return options


#: NCCL's switch for CollNet (SHARP), read when a communicator is created
COLLNET_ENV = "NCCL_COLLNET_ENABLE"


def sharp_applies(dist_cfg: DistributedInitConfig, backend: str, device: Any) -> bool:
    """Whether ``dist.use_sharp`` acts on this run: NCCL groups on CUDA (elsewhere start-up lists it as not
    applicable; validate() rejects it with another backend)."""
    return bool(dist_cfg.use_sharp) and backend == "nccl" and device.type == "cuda"


def clear_collnet_environment() -> None:
    """Remove ``NCCL_COLLNET_ENABLE``: no communicator but the data-parallel one may be created with CollNet."""
    os.environ.pop(COLLNET_ENV, None)


def start_sharp_communicator(group: Any, device: Any, barrier: Callable[[Any, Any], None] | None = None) -> None:
    """Create ``group``'s NCCL communicator with CollNet enabled (a barrier on it), then clear the switch again.

    ``barrier(group, device)`` defaults to ``torch.distributed.barrier`` on ``device`` followed by a CUDA
    synchronize (torch creates a communicator at its group's first collective)."""
    if barrier is None:
        barrier = _device_barrier
    os.environ[COLLNET_ENV] = "1"
    try:
        barrier(group, device)
    finally:
        clear_collnet_environment()


def _device_barrier(group: Any, device: Any) -> None:
    # torch on first use: parallel.init imports this module in the launcher, which runs without torch
    import torch
    import torch.distributed as dist

    dist.barrier(group=group, device_ids=[device.index])
    torch.cuda.synchronize(device)
