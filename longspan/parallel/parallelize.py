"""Turn a plain (meta-device) model into the distributed model the layout asks for.

Plans are applied from the outside (torchtitan's way): tensor/sequence parallel with DTensor plans, then
data parallel (DDP or FSDP2). The model code never knows.
"""

from __future__ import annotations

from typing import Any

import torch

from longspan.core.errors import NotSupportedError


def parallelize_model(model: torch.nn.Module, cfg: Any, parallel: Any) -> torch.nn.Module:
    """Apply the parallel plans for ``cfg``'s layout to ``model`` (still on the meta device)."""
    if parallel.world_size == 1:
        return model
    raise NotSupportedError(
        f"world size {parallel.world_size}: multi-process layouts are not supported yet by this build"
    )
