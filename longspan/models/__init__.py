"""Models (plain ``nn.Module``) and their providers (configuration dataclasses).

Owns GPT (dense, MoE), Mamba/hybrid and T5 models, their providers, weight init, RoPE, the loss and the FLOP
counts. No process groups here: parallelism is applied from outside by ``longspan.parallel``. The providers and
activation functions register themselves with the config package's allowlist (``longspan.config.targets``); the
model families' providers (``longspan.families``) are found here by name too (as attributes of ``longspan.models``).

May import: core, config, data (its own layer).
"""

from __future__ import annotations

from typing import Any

from longspan.config.targets import register_callable, register_config_class, registered_class
from longspan.models.activations import gelu_tanh, quick_gelu, squared_relu
from longspan.models.gpt_provider import GPTModelProvider, TransformerConfig
from longspan.models.mamba_provider import MambaProvider
from longspan.models.t5_provider import T5ModelProvider

__all__ = ["GPTModelProvider", "T5ModelProvider", "MambaProvider", "TransformerConfig", "GPTModel"]

# The model section's classes; the first is built for a model mapping without ``_target_``, and other Bridge
# providers whose name matches none of the patterns load as it.
register_config_class(GPTModelProvider, "model", "longspan.models", foreign_names=(
    "megatron.bridge.models.gpt_provider.GPTModelProvider", "megatron.bridge.models.GPTModelProvider"))
register_config_class(T5ModelProvider, "model", "longspan.models", foreign_names=(
    "megatron.bridge.models.T5ModelProvider", "megatron.bridge.models.t5_provider.T5ModelProvider"),
    bridge_provider_pattern="T5")
register_config_class(MambaProvider, "model", "longspan.models", foreign_names=(
    "megatron.bridge.models.mamba.mamba_provider.MambaProvider", "megatron.bridge.models.MambaProvider"),
    bridge_provider_pattern="Mamba|NemotronH")
register_callable(gelu_tanh, aliases=("gelu_tanh", "openai_gelu"))
register_callable(squared_relu, aliases=("squared_relu", "megatron.core.activations.squared_relu"))
register_callable(quick_gelu, aliases=("quick_gelu", "megatron.core.fusions.fused_bias_geglu.quick_gelu"))


def __getattr__(name: str) -> Any:
    # GPTModel pulls in the model code; import it only when asked for, so configs stay light.
    if name == "GPTModel":
        from longspan.models.gpt import GPTModel  # the model code loads only when asked for (see above)

        return GPTModel
    # A model family's provider (longspan.models.<Family>ModelProvider): registered by its package. Dunder
    # names (probes by import machinery and tools) never load the families.
    cls = None if name.startswith("__") else registered_class(name, "longspan.models")
    if cls is not None:
        return cls
    raise AttributeError(f"module 'longspan.models' has no attribute {name!r}")
