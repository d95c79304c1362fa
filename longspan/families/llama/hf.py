"""Llama (``LlamaForCausalLM``): the standard decoder, as config.json and weights."""

from __future__ import annotations

from typing import Any

from longspan.conversion.decoder_fields import decoder_hf, decoder_provider
from longspan.conversion.families import Family
from longspan.conversion.mapping import DECODER


def llama_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a Llama config.json."""
    return decoder_provider(cfg, family="Llama")


def llama_hf(p: Any) -> dict[str, Any]:
    """A Llama config.json body for provider ``p``."""
    return decoder_hf(p, family="Llama")


LLAMA = Family("llama", "LlamaForCausalLM", "llama", DECODER, llama_provider, llama_hf)
