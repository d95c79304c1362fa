"""Rules of the optimizer CPU offload fields (``optimizer.optimizer_cpu_offload`` and its companions).

Part of ``ConfigContainer.validate()`` (``validate.py``); every failure is one ``ConfigError`` line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from longspan.core.errors import ConfigError, NotSupportedError

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer


def check_optimizer_offload(cfg: "ConfigContainer") -> None:
    """An offload that offloads something, not with the precision-aware optimizer."""
    opt = cfg.optimizer
    fraction = opt.optimizer_offload_fraction
    if not opt.optimizer_cpu_offload:
        for name, value in (("optimizer_offload_fraction", fraction),
                            ("overlap_cpu_optimizer_d2h_h2d", opt.overlap_cpu_optimizer_d2h_h2d)):
            if value:
                raise ConfigError(f"optimizer.{name}={value} needs optimizer.optimizer_cpu_offload=True")
        return
    if not fraction:
        raise ConfigError("optimizer.optimizer_cpu_offload=True with optimizer.optimizer_offload_fraction=0.0 "
                          "offloads nothing: set the fraction of the optimizer state to keep on the CPU, in (0, 1]")
    if opt.use_precision_aware_optimizer:
        raise NotSupportedError("optimizer.optimizer_cpu_offload=True is not supported yet with "
                                "optimizer.use_precision_aware_optimizer=True: set one of them to False")
