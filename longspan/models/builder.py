"""One entry point that builds any provider's model on the meta device (GPT, Mamba, T5, ...).

``longspan.training.setup`` and ``longspan.parallel.pipeline`` call ``build_meta_model(provider, ...)``; a
provider that is not a GPT provider brings its own model by defining ``provide_meta(pre_process,
post_process, vp_stage, layer_numbers)``, which returns its plain model on the meta device (parameters
drawn later by ``longspan.models.init.init_weights``, after the parallel plans).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from longspan.models.gpt import build_gpt_model


def build_meta_model(
    provider: Any,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    *,
    layer_numbers: list[int] | None = None,
) -> nn.Module:
    """``provider``'s model (or one pipeline stage of it: ``layer_numbers``) on the meta device, not initialized."""
    provide_meta = getattr(provider, "provide_meta", None)
    if provide_meta is not None:
        return provide_meta(pre_process, post_process, vp_stage, layer_numbers)
    return build_gpt_model(provider, pre_process, post_process, vp_stage, materialize=False, layer_numbers=layer_numbers)
