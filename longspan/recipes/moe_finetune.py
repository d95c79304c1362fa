"""``moe_lora``: LoRA finetuning of a mixture-of-experts Hugging Face model (GLM-4.5 / 4.6, Qwen3-MoE, Mixtral,
DeepSeek-V3).

The architecture, weights and tokenizer come from ``checkpoint.pretrained_checkpoint`` (an HF directory); the
adapters go on attention (``linear_qkv``, ``linear_proj``; with multi-latent attention its own projections:
``linear_q_proj`` or ``linear_q_down_proj`` + ``linear_q_up_proj``, ``linear_kv_down_proj``,
``linear_kv_up_proj``, and ``linear_proj``) and on every MLP projection (``linear_fc1``, ``linear_fc2``): the
dense first layers' MLPs, the shared experts, and the routed experts, where each expert gets its own adapter
(3-D LoRA factors next to the grouped expert weights). A target a model does not have adapts nothing. The
routers (and the base weights) stay frozen; the aux-loss-free routing bias keeps moving and is saved with the
adapters::

    longspan finetune --recipe moe-lora checkpoint.pretrained_checkpoint=GLM_DIR dataset.dataset_root=DATA

Hyperparameters are the ``lora`` recipe's (rank 32, alpha 32, lr 1e-4, cosine decay after a short warmup) in
bf16 mixed precision; any of them can be overridden. ``peft.exclude_modules=['*.experts.*']`` keeps the routed
experts frozen too (adapters on attention, dense and shared-expert MLPs only).
"""

from __future__ import annotations

from longspan.peft import LoRA
from longspan.recipes.finetune import finetune_recipe
from longspan.training.config import ConfigContainer

#: attention (fused q/k/v, or multi-latent attention's projections), its output projection, every MLP projection
MOE_LORA_TARGETS = ["linear_qkv", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                    "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2"]


def moe_lora() -> ConfigContainer:
    """LoRA on attention and every expert (routed and shared) of an MoE HF model (checkpoint.pretrained_checkpoint)."""
    cfg = finetune_recipe("moe_lora", lr=1e-4)
    cfg.peft = LoRA(target_modules=list(MOE_LORA_TARGETS))
    cfg.mixed_precision = "bf16_mixed"
    return cfg
