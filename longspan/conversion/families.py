"""The supported Hugging Face architectures: one ``Family`` per architecture (names, weight table, config translation).

The translations live per family group: ``dense_families`` (Llama, Mistral, Ministral, Qwen2, Qwen3, Phi-3,
GPT-2); the families' own packages (``longspan.families``) register theirs; the helpers they share (dtypes,
RoPE, sliding windows, activations) are in
``config_fields``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

import longspan.conversion.mapping as mapping
from longspan.conversion.config_fields import DTYPE_NAMES
from longspan.core.errors import NotSupportedError
from longspan.core.logging import get_logger, print_rank_0
from longspan.core.plugins import load_plugins
from longspan.models.gpt_provider import GPTModelProvider

_log = get_logger(__name__)


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
    provider_class: type = GPTModelProvider
    """The provider class ``to_provider``'s fields are for."""
    weights_for: Callable[[dict[str, Any]], tuple[mapping.WeightMap, ...]] | None = None
    """When set, the weight table depends on config.json (T5's gated or plain MLP): it replaces ``weights``."""
    hf_prefix_aliases: tuple[tuple[str, str], ...] = ()
    """(prefix, other spelling) of HF tensor names: files that use the other spelling load too."""
    export_architecture: str | None = None
    """When set, the import is a part of a bigger HF model (a vision-language model's text tower) and exports
    as this architecture (``export_config`` turns the source config.json into its config.json)."""
    export_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    tie_word_embeddings_default: bool = False
    """Whether the architecture ties its output layer to the embeddings when config.json does not say (the
    default of its transformers config class)."""
    mtp_layers: bool = False
    """config.json's ``num_nextn_predict_layers`` counts multi-token-prediction layers stored after the decoder
    (``mapping.with_mtp``; ``weights_for`` adds them): the import reads them into ``mtp.layers.*``, the export
    writes the model's (``longspan.conversion.mtp_layers``)."""
    text_tower: "Family | None" = None
    """A vision-language architecture's text-only import (its language model, exported as the causal LM), for a
    run whose model is a text model (a text recipe on the HF directory); not registered apart."""

    def for_config(self, cfg: dict[str, Any]) -> "Family":
        """This family with the weight table for config.json dict ``cfg``."""
        return self if self.weights_for is None else replace(self, weights=self.weights_for(cfg))


FAMILIES: tuple[Family, ...] = (
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
    """The family registered as ``name`` (``Family.name``, e.g. ``qwen3``), or a registered one's text tower."""
    for family in all_families():
        for candidate in (family, family.text_tower):
            if candidate is not None and candidate.name == name:
                return candidate
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


_provider_fallback: Callable[[Any], Family] | None = None


def set_provider_fallback(infer: Callable[[Any], Family]) -> None:
    """Install the inference ``family_for_provider`` falls back on (``longspan.families.fallback`` installs it:
    choosing between the families is theirs to do)."""
    global _provider_fallback
    _provider_fallback = infer


def family_for_provider(provider: Any) -> Family:
    """The HF architecture a longspan model exports as when nothing recorded its family (a checkpoint without
    ``model_family.json``, a provider built by hand): inferred from the provider's class and fields."""
    load_plugins()
    if _provider_fallback is None:
        raise NotSupportedError(f"cannot tell which HF architecture a {type(provider).__name__} exports as: "
                                "name one (architecture=...)")
    family = _provider_fallback(provider)
    print_rank_0(f"no recorded model family: exporting as {family.architecture} (inferred from the model's "
                 "fields; pass an architecture to choose another)", _log)
    return family


def hf_config_dict(family: Family, provider: Any) -> dict[str, Any]:
    """A complete config.json dict for ``provider`` exported as ``family``."""
    body = family.to_hf(provider)
    dtype = provider.params_dtype or torch.float32
    return {"architectures": [family.architecture], "model_type": family.model_type, **body,
            "dtype": DTYPE_NAMES.get(dtype, "float32")}
