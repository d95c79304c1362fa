"""Which HF architecture a model exports as when its checkpoint does not say (checkpoints written before
checkpoints recorded their family, providers built by hand): an inference from the provider's class and fields.

A checkpoint of a family recipe, an HF import or a run started from an HF directory records its family
(``model_family.json``, read by ``AutoBridge.for_run``); this guess is the fallback
(``longspan.conversion.families.family_for_provider``). It is the one place outside the family packages that
names the families, because it chooses between them; the checks run in order, the more specific first.
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.families import Family, by_architecture, set_provider_fallback
from longspan.core.errors import NotSupportedError
from longspan.models.gpt_provider import GPTModelProvider
from longspan.models.mamba_provider import MambaProvider
from longspan.models.t5_provider import T5ModelProvider
from longspan.models.vlm.provider import VisionLanguageProvider


def _is_pure_mamba(provider: MambaProvider) -> bool:
    """Whether a Mamba stack has Mamba layers only (no attention or MLP layers)."""
    pattern = provider.hybrid_override_pattern
    if pattern:
        return set(pattern) == {"M"}
    return not (provider.hybrid_attention_ratio or provider.hybrid_mlp_ratio)


def _architecture(provider: Any) -> str:
    """The HF ``architectures`` name ``provider``'s model most likely is."""
    if isinstance(provider, VisionLanguageProvider):
        return provider.hf_architecture
    if isinstance(provider, T5ModelProvider):
        return "T5ForConditionalGeneration"
    if isinstance(provider, MambaProvider):
        return "Mamba2ForCausalLM" if _is_pure_mamba(provider) else "NemotronHForCausalLM"
    if not isinstance(provider, GPTModelProvider):
        raise NotSupportedError(f"cannot tell which HF architecture a {type(provider).__name__} exports as: "
                                "name one (architecture=...)")
    if provider.multi_latent_attention:
        return "DeepseekV3ForCausalLM"
    if provider.position_embedding_type == "learned_absolute":
        return "GPT2LMHeadModel"
    if not provider.layernorm_before_sublayers:
        return "Olmo2ForCausalLM"
    if provider.layernorm_after_sublayers:
        return "Gemma3ForCausalLM" if provider.qk_layernorm else "Gemma2ForCausalLM"
    if provider.num_moe_experts and provider.softmax_type == "learnable":
        return "GptOssForCausalLM"
    if provider.num_moe_experts and provider.moe_router_score_function == "sigmoid":
        return "Glm4MoeForCausalLM"  # DeepSeek-V3 routing with Llama-style attention
    if provider.num_moe_experts:
        return "Qwen3MoeForCausalLM" if provider.qk_layernorm else "MixtralForCausalLM"
    if provider.qk_layernorm:
        return "Qwen3ForCausalLM"
    if provider.add_qkv_bias and not provider.add_bias_linear:
        return "Qwen2ForCausalLM"
    window = provider.window_size
    if window is not None and window[0] != -1:  # Llama has no sliding window
        return "MistralForCausalLM"
    return "LlamaForCausalLM"


def infer_family(provider: Any) -> Family:
    """The family ``provider``'s model exports as, inferred from its class and fields."""
    return by_architecture()[_architecture(provider)]


set_provider_fallback(infer_family)
