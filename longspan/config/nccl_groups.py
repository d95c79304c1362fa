"""Per-group NCCL settings of ``dist.high_priority_stream_groups`` and ``dist.nccl_communicator_config_path``,
read and checked without torch (validate() runs them on every machine; longspan.parallel.nccl_options builds
the process-group options on CUDA)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import yaml

from longspan.core.errors import ConfigError

if TYPE_CHECKING:  # the schema's dist section names this module's rules
    from longspan.config.schema.infra import DistributedInitConfig

# The groups of longspan's device meshes: the dense mesh's dims, their flattened combinations, the expert mesh's.
GROUP_NAMES = ("tp", "cp", "pp", "dp", "dp_cp", "dp_shard_cp", "dp_replicate", "dp_shard", "mp", "ep", "etp", "edp")
# Megatron's per-communicator keys and the defaults it gives a group the file names.
NCCL_CONFIG_DEFAULTS = {"cga_cluster_size": 4, "max_ctas": 32, "min_ctas": 1}


def _check_names(field: str, names: Any) -> None:
    unknown = sorted(str(n) for n in names if n not in GROUP_NAMES)
    if unknown:
        raise ConfigError(f"dist.{field} names unknown group(s) {', '.join(unknown)}: longspan's groups are "
                          f"{', '.join(GROUP_NAMES)}")


def read_nccl_communicator_config(path: str) -> dict[str, dict[str, int]]:
    """``{group: {cga_cluster_size, max_ctas, min_ctas}}`` from Megatron's YAML file, defaults filled in."""
    if not os.path.isfile(path):
        raise ConfigError(f"dist.nccl_communicator_config_path={path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"dist.nccl_communicator_config_path={path!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ConfigError(f"dist.nccl_communicator_config_path={path!r} must map group names to settings")
    _check_names("nccl_communicator_config_path", data)
    out = {}
    for group, settings in data.items():
        unknown = sorted(str(k) for k in settings if k not in NCCL_CONFIG_DEFAULTS)
        bad = [k for k, v in settings.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if unknown or bad:
            raise ConfigError(f"dist.nccl_communicator_config_path={path!r}: group {group!r} takes positive integers "
                              f"for {', '.join(NCCL_CONFIG_DEFAULTS)} (got {settings!r})")
        out[str(group)] = {**NCCL_CONFIG_DEFAULTS, **settings}
    return out


def nccl_group_settings(dist_cfg: DistributedInitConfig) -> dict[str, dict[str, Any]]:
    """``{group: {"high_priority": bool, **communicator settings}}`` for every group the two fields name."""
    high = dist_cfg.high_priority_stream_groups or []
    if not isinstance(high, (list, tuple)):
        raise ConfigError(f"dist.high_priority_stream_groups={high!r} must be a list of group names")
    _check_names("high_priority_stream_groups", high)
    path = dist_cfg.nccl_communicator_config_path
    communicators = read_nccl_communicator_config(path) if path else {}
    return {name: {"high_priority": name in high, **communicators.get(name, {})}
            for name in dict.fromkeys(list(high) + list(communicators))}
