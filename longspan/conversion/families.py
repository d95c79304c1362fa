"""The supported Hugging Face architectures: one ``Family`` per architecture (names, weight table, config translation).

The translations live per family group: ``dense_families`` (Llama, Mistral, Ministral, Qwen2, Qwen3, Phi-3,
GPT-2), ``moe_families`` (Mixtral, Qwen3-MoE), ``gpt_oss_families`` (GPT-OSS), ``glm_families`` (GLM-4.5),
``deepseek_families`` (DeepSeek-V3), ``t5_families`` (T5, mT5), ``mamba_families`` (Mamba-2, Nemotron-H),
``qwen_vl_families`` (Qwen2.5-VL); the helpers they share (dtypes, RoPE, sliding windows, activations) are in
``config_fields``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

import longspan.conversion.mapping as mapping
from longspan.conversion.config_fields import DTYPE_NAMES
from longspan.conversion.mamba_families import (
    mamba2_hf,
    mamba2_provider,
    mamba2_weights,
    nemotron_h_hf,
    nemotron_h_provider,
    nemotron_h_weights,
)
from longspan.conversion.qwen_vl_families import QWEN25_VL, QWEN25_VL_ALIASES, qwen25_vl_hf, qwen25_vl_provider
from longspan.conversion.t5_families import mt5_hf, mt5_provider, t5_hf, t5_provider, t5_weights
from longspan.core.errors import NotSupportedError
from longspan.core.plugins import load_plugins


@dataclass(frozen=True)
class Family:
    """One HF architecture: its names, weight table and config translation."""

    name: str
    architecture: str
    model_type: str
    weights: tuple[mapping.WeightMap, ...]
    to_provider: Callable[[dict[str, Any]], dict[str, Any]]
    """config.json dict -> GPTModelProvider keyword arguments."""
    to_hf: Callable[[Any], dict[str, Any]]
    """GPTModelProvider -> config.json dict (without architectures/model_type/dtype)."""
    provider_class: str = "GPTModelProvider"
    """The ``longspan.models`` provider class ``to_provider``'s fields are for."""
    weights_for: Callable[[dict[str, Any]], tuple[mapping.WeightMap, ...]] | None = None
    """When set, the weight table depends on config.json (T5's gated or plain MLP): it replaces ``weights``."""
    hf_prefix_aliases: tuple[tuple[str, str], ...] = ()
    """(prefix, other spelling) of HF tensor names: files that use the other spelling load too."""
    export_architecture: str | None = None
    """When set, the import is a part of a bigger HF model (a vision-language model's text tower) and exports
    as this architecture (``export_config`` turns the source config.json into its config.json)."""
    export_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    mtp_layers: bool = False
    """config.json's ``num_nextn_predict_layers`` counts multi-token-prediction layers stored after the decoder
    (``mapping.with_mtp``; ``weights_for`` adds them): the import reads them into ``mtp.layers.*``, the export
    writes the model's (``longspan.conversion.mtp_layers``)."""

    def for_config(self, cfg: dict[str, Any]) -> "Family":
        """This family with the weight table for config.json dict ``cfg``."""
        return self if self.weights_for is None else replace(self, weights=self.weights_for(cfg))


FAMILIES: tuple[Family, ...] = (
    Family("t5", "T5ForConditionalGeneration", "t5", mapping.T5, t5_provider, t5_hf, "T5ModelProvider", t5_weights),
    Family("mt5", "MT5ForConditionalGeneration", "mt5", mapping.T5, mt5_provider, mt5_hf, "T5ModelProvider",
           t5_weights),
    Family("mamba2", "Mamba2ForCausalLM", "mamba2", mapping.mamba2(1, 1, 1), mamba2_provider, mamba2_hf,
           "MambaProvider", mamba2_weights),
    Family("nemotron_h", "NemotronHForCausalLM", "nemotron_h", mapping.nemotron_h(1, 1, 1), nemotron_h_provider,
           nemotron_h_hf, "MambaProvider", nemotron_h_weights),
    Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", QWEN25_VL, qwen25_vl_provider,
           qwen25_vl_hf, "Qwen25VLModelProvider", hf_prefix_aliases=QWEN25_VL_ALIASES),
)

_REGISTERED: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add one HF architecture (called by its family package in ``longspan.families``); names are unique."""
    for known in (*FAMILIES, *_REGISTERED.values()):
        if family.architecture == known.architecture or family.name == known.name:
            raise ValueError(f"HF family {family.name} ({family.architecture}) is registered twice")
    _REGISTERED[family.architecture] = family
    return family


def all_families() -> tuple[Family, ...]:
    """Every registered HF architecture, in registration order."""
    load_plugins()
    return (*FAMILIES, *_REGISTERED.values())


def by_architecture() -> dict[str, Family]:
    """HF ``architectures`` name -> its family."""
    return {f.architecture: f for f in all_families()}


def family_named(name: str) -> Family:
    """The family registered as ``name`` (``Family.name``, e.g. ``qwen3``)."""
    for family in all_families():
        if family.name == name:
            return family
    raise NotSupportedError(f"unknown model family {name!r}: longspan knows "
                            f"{', '.join(f.name for f in all_families())}")


def supported_architectures() -> list[str]:
    """The HF ``architectures`` names longspan converts."""
    return [f.architecture for f in all_families()]


def family_for_config(cfg: dict[str, Any]) -> Family:
    """The family of a config.json dict, from its ``architectures`` entry (or ``model_type``)."""
    archs = cfg.get("architectures") or []
    known = by_architecture()
    for arch in archs:
        if arch in known:
            return known[arch]
    if not archs:
        for family in all_families():
            if family.model_type == cfg.get("model_type"):
                return family
    named = ", ".join(archs) if archs else f"model_type={cfg.get('model_type')!r}"
    raise NotSupportedError(
        f"HF architecture {named} is not supported: longspan converts {', '.join(supported_architectures())}"
    )


def family_for_provider(provider: Any) -> Family:
    """The HF architecture a longspan model exports as (for checkpoints that were not imported from HF)."""
    if type(provider).__name__ == "Gemma3VLModelProvider":
        return by_architecture()["Gemma3ForConditionalGeneration"]
    if type(provider).__name__ == "T5ModelProvider":
        return by_architecture()["T5ForConditionalGeneration"]
    if type(provider).__name__ == "Qwen25VLModelProvider":
        return by_architecture()["Qwen2_5_VLForConditionalGeneration"]
    if type(provider).__name__ == "MambaProvider":
        pattern = provider.hybrid_override_pattern
        pure = (set(pattern) == {"M"}) if pattern else not (provider.hybrid_attention_ratio or provider.hybrid_mlp_ratio)
        return by_architecture()["Mamba2ForCausalLM" if pure else "NemotronHForCausalLM"]
    if getattr(provider, "multi_latent_attention", False):
        return by_architecture()["DeepseekV3ForCausalLM"]
    if provider.position_embedding_type == "learned_absolute":
        return by_architecture()["GPT2LMHeadModel"]
    if not getattr(provider, "layernorm_before_sublayers", True):
        return by_architecture()["Olmo2ForCausalLM"]
    if getattr(provider, "layernorm_after_sublayers", False):
        return by_architecture()["Gemma3ForCausalLM" if provider.qk_layernorm else "Gemma2ForCausalLM"]
    if provider.num_moe_experts and getattr(provider, "softmax_type", "vanilla") == "learnable":
        return by_architecture()["GptOssForCausalLM"]
    if provider.num_moe_experts and provider.moe_router_score_function == "sigmoid":
        return by_architecture()["Glm4MoeForCausalLM"]  # DeepSeek-V3 routing with Llama-style attention
    if provider.num_moe_experts:
        return by_architecture()["Qwen3MoeForCausalLM" if provider.qk_layernorm else "MixtralForCausalLM"]
    if provider.qk_layernorm:
        return by_architecture()["Qwen3ForCausalLM"]
    if provider.add_qkv_bias and not provider.add_bias_linear:
        return by_architecture()["Qwen2ForCausalLM"]
    window = getattr(provider, "window_size", None)
    if window is not None and window[0] != -1:  # Llama has no sliding window
        return by_architecture()["MistralForCausalLM"]
    return by_architecture()["LlamaForCausalLM"]


def hf_config_dict(family: Family, provider: Any) -> dict[str, Any]:
    """A complete config.json dict for ``provider`` exported as ``family``."""
    body = family.to_hf(provider)
    dtype = provider.params_dtype or torch.float32
    return {"architectures": [family.architecture], "model_type": family.model_type, **body,
            "dtype": DTYPE_NAMES.get(dtype, "float32")}
