"""NCCL process-group options from ``dist.high_priority_stream_groups`` and ``dist.nccl_communicator_config_path``
(Megatron's per-communicator settings): ``ProcessGroupNCCL.Options`` with a high-priority stream and the
communicator's CGA cluster size and CTA bounds, handed to the device meshes' groups (``build_device_mesh``).
Only NCCL groups on CUDA take them; elsewhere start-up lists the fields as not applicable."""

from __future__ import annotations

from typing import Any

from longspan.config.nccl_groups import nccl_group_settings


def nccl_group_options(dist_cfg: Any) -> dict[str, Any]:
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
