"""Models (plain ``nn.Module``) and their providers (configuration dataclasses).

Owns GPT (dense, MoE), Mamba/hybrid and T5 models, their providers, weight init, RoPE, the loss and the FLOP
counts. No process groups here: parallelism is applied from outside by ``longspan.parallel``.

May import: core, config, data (its own layer).
"""

from __future__ import annotations

from typing import Any

from longspan.models.gpt_provider import GPTModelProvider, TransformerConfig
from longspan.models.mamba_provider import MambaProvider
from longspan.models.t5_provider import T5ModelProvider
from longspan.models.vlm import Qwen25VLModelProvider

__all__ = ["GPTModelProvider", "T5ModelProvider", "MambaProvider", "Qwen25VLModelProvider", "TransformerConfig",
           "GPTModel"]


def __getattr__(name: str) -> Any:
    # GPTModel pulls in the model code; import it only when asked for, so configs stay light.
    if name == "GPTModel":
        from longspan.models.gpt import GPTModel  # the model code loads only when asked for (see above)

        return GPTModel
    raise AttributeError(f"module 'longspan.models' has no attribute {name!r}")
