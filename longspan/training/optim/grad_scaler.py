"""Loss scalers for fp16 training, with megatron-core's semantics.

The optimizer multiplies the loss by ``scale`` before backward and divides the gradients by it afterwards.
``ConstantGradScaler`` never changes the scale (``OptimizerConfig.loss_scale`` set). ``DynamicGradScaler``
(fp16 with ``loss_scale=None``) backs off after ``hysteresis`` overflowing iterations and grows after
``growth_interval`` (``loss_scale_window``) clean iterations in a row. Unlike megatron-core the scale tensor
lives on whatever device the parameters use (CPU or CUDA), not always CUDA.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from longspan.core.errors import ConfigError

__all__ = ["MegatronGradScaler", "ConstantGradScaler", "DynamicGradScaler"]


class MegatronGradScaler(ABC):
    """Base class: holds the current loss scale as a one-element float32 tensor.

    Args:
        initial_scale: the first loss scale; must be positive.
        device: where the scale tensor lives (the parameters' device); CPU when None.
    """

    def __init__(self, initial_scale: float, device: torch.device | str | None = None) -> None:
        if not initial_scale > 0.0:
            raise ConfigError(
                f"optimizer.initial_loss_scale/loss_scale={initial_scale} is invalid: the loss scale must be > 0"
            )
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float, device=self.device)

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale, shape ``[1]``, float32."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` computed in float64 then rounded to float32, as megatron-core does."""
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool) -> None:
        """Adjust the scale after an iteration; ``found_inf`` says whether the gradients overflowed."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore state written by :meth:`state_dict`."""


class ConstantGradScaler(MegatronGradScaler):
    """A loss scale that never changes, whatever overflows are seen (megatron-core: empty state)."""

    def update(self, found_inf: bool) -> None:
        """Nothing to do: the scale is constant."""

    def state_dict(self) -> dict[str, Any]:
        """Nothing to save: the scale comes from the config."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load."""


class DynamicGradScaler(MegatronGradScaler):
    """A loss scale adjusted during training.

    After ``hysteresis`` overflowing iterations (counted down and not reset by a clean iteration, only by a
    growth) the scale is multiplied by ``backoff_factor`` (never below ``min_scale``), and again at every
    further overflow until it grows. After ``growth_interval`` clean iterations in a row it is multiplied by
    ``growth_factor`` and the hysteresis budget is restored.

    Args:
        initial_scale: first scale (``OptimizerConfig.initial_loss_scale``).
        min_scale: lower bound (``OptimizerConfig.min_loss_scale``); 0 < min_scale <= initial_scale.
        growth_factor: > 1 (megatron-core uses 2).
        backoff_factor: in (0, 1) (megatron-core uses 0.5).
        growth_interval: clean iterations before growing (``OptimizerConfig.loss_scale_window``); > 0.
        hysteresis: overflowing iterations tolerated before backing off (``OptimizerConfig.hysteresis``); > 0.
        device: where the scale tensor lives; CPU when None.
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(initial_scale, device)
        if not 0.0 < min_scale <= initial_scale:
            raise ConfigError(
                f"optimizer.min_loss_scale={min_scale} is invalid: it must be > 0 and <= "
                f"initial_loss_scale ({initial_scale})"
            )
        if not growth_factor > 1.0:
            raise ConfigError(f"grad scaler growth_factor={growth_factor} is invalid: it must be > 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ConfigError(f"grad scaler backoff_factor={backoff_factor} is invalid: it must be in (0, 1)")
        if not int(growth_interval) > 0:
            raise ConfigError(f"optimizer.loss_scale_window={growth_interval} is invalid: it must be > 0")
        if not int(hysteresis) > 0:
            raise ConfigError(f"optimizer.hysteresis={hysteresis} is invalid: it must be > 0")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float, device=self.device)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float, device=self.device)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float, device=self.device)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Count the iteration towards a backoff (overflow) or a growth (clean)."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        """megatron-core's keys: ``scale`` (tensor), ``growth_tracker``, ``hysteresis_tracker``."""
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scale (moved to this scaler's device) and both trackers."""
        scale = state_dict["scale"]
        if not isinstance(scale, torch.Tensor):
            scale = torch.tensor([float(scale)])
        self._scale = scale.detach().to(device=self.device, dtype=torch.float).reshape(1).clone()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
