"""Parameter-efficient finetuning: LoRA, DoRA and canonical LoRA applied from outside the model.

``from longspan.peft import LoRA, DoRA, CanonicalLoRA`` (Megatron Bridge's classes and field names); a config
in ``ConfigContainer.peft`` makes ``pretrain``/``finetune`` build the model on the meta device, add the
adapters (``peft.apply(chunk)``), freeze the base, apply the parallel plans, load the base weights from
``checkpoint.pretrained_checkpoint`` and train (and checkpoint) only the adapters.

May import: core, config, models, data, parallel.
"""

from longspan.config.targets import register_config_class
from longspan.peft.config import PEFT, PEFT_CLASSES, CanonicalLoRA, DoRA, LoRA

__all__ = ["PEFT", "PEFT_CLASSES", "LoRA", "DoRA", "CanonicalLoRA"]

# The peft section's classes, written as longspan.peft.<name>; Bridge's module paths load as them.
register_config_class(LoRA, "peft", "longspan.peft", foreign_names=(
    "megatron.bridge.peft.lora.LoRA", "megatron.bridge.peft.lora.lora.LoRA"))
register_config_class(DoRA, "peft", "longspan.peft", foreign_names=(
    "megatron.bridge.peft.dora.DoRA", "megatron.bridge.peft.lora.dora.DoRA"))
register_config_class(CanonicalLoRA, "peft", "longspan.peft", foreign_names=(
    "megatron.bridge.peft.canonical_lora.CanonicalLoRA", "megatron.bridge.peft.lora.canonical_lora.CanonicalLoRA"))
