"""One entry point that builds any provider's model on the meta device (GPT, Mamba, T5, ...).

``longspan.training.setup`` and ``longspan.parallel.pipeline`` call ``build_meta_model(provider, ...)``; a
model provider (``ModelProviderMixin``) brings its own model through ``provide_meta(pre_process,
post_process, vp_stage, layer_numbers)``, which returns its plain model on the meta device (parameters
drawn later by ``longspan.models.init.init_weights``, after the parallel plans); any other config with the GPT
provider's fields builds a GPT model.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from longspan.models.gpt import build_gpt_model
from longspan.models.gpt_provider import ModelProviderMixin


def build_meta_model(
    provider: Any,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    *,
    layer_numbers: list[int] | None = None,
) -> nn.Module:
    """``provider``'s model (or one pipeline stage of it: ``layer_numbers``) on the meta device, not initialized."""
    if isinstance(provider, ModelProviderMixin):
        return provider.provide_meta(pre_process, post_process, vp_stage, layer_numbers)
    return build_gpt_model(provider, pre_process, post_process, vp_stage, materialize=False, layer_numbers=layer_numbers)
