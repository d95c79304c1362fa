"""Rules of the Muon optimizer fields (``optimizer.optimizer='muon'`` and ``optimizer.muon_*``).

Part of ``ConfigContainer.validate()`` (``validate.py``); every failure is one ``ConfigError`` line naming the
field, its value and what is valid.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from longspan.core.errors import ConfigError, NotSupportedError

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer

#: Megatron's 'quintic' Newton-Schulz schedule has five coefficient sets, cycled whole.
NS_COEFFICIENT_SETS = 5


def check_muon(cfg: "ConfigContainer") -> None:
    """Muon's fields only with Muon; Muon only with what can orthogonalise whole weight matrices."""
    opt = cfg.optimizer
    if opt.optimizer == "dist_muon":
        raise NotSupportedError(
            "optimizer.optimizer='dist_muon' (Megatron's layer-wise distributed Muon) is not supported yet: set "
            "optimizer.optimizer='muon' with optimizer.use_distributed_optimizer=true, which shards Muon's state "
            "over the data-parallel ranks")
    if opt.optimizer != "muon":
        defaults = type(opt)()
        for f in fields(opt):
            if f.name.startswith("muon_") and getattr(opt, f.name) != getattr(defaults, f.name):
                raise ConfigError(f"optimizer.{f.name}={getattr(opt, f.name)!r} applies to optimizer.optimizer='muon' "
                                  f"only; this run uses optimizer.optimizer={opt.optimizer!r}")
        return
    steps = opt.muon_num_ns_steps
    if steps % NS_COEFFICIENT_SETS:
        raise ConfigError(f"optimizer.muon_num_ns_steps={steps} is invalid: the quintic Newton-Schulz schedule "
                          f"cycles {NS_COEFFICIENT_SETS} coefficient sets, so use a positive multiple of 5")
    if opt.muon_tp_mode == "distributed":
        raise NotSupportedError("optimizer.muon_tp_mode='distributed' is not supported yet: 'duplicated' computes "
                                "the same update (the whole matrix on every tensor-parallel rank)")
    # Both keep a parameter's state and update as per-rank pieces the Newton-Schulz iteration never sees whole.
    if opt.optimizer_cpu_offload:
        raise NotSupportedError("optimizer.optimizer_cpu_offload=True is not supported yet with "
                                "optimizer.optimizer='muon': the host part steps each rank's shard of a matrix "
                                "on its own, which Muon cannot orthogonalise")
    if opt.use_precision_aware_optimizer:
        raise NotSupportedError("optimizer.use_precision_aware_optimizer=True is not supported yet with "
                                "optimizer.optimizer='muon' (it is an AdamW of its own): set it to False")
