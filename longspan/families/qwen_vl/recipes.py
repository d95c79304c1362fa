"""Vision-language finetuning recipes: ``vlm-sft`` (full finetune) and ``vlm-lora`` (LoRA on the language model).

The model is the pretrained checkpoint's, a Qwen2.5-VL, Gemma 3 VL or Gemma 4 Hugging Face directory (family and
architecture from its config.json, replacing the recipe's placeholder; tokenizer, image processor and chat
template from its files). The data is a ``FinetuningDatasetConfig``
directory of chat records whose messages mix ``{"type": "image", "image": PATH}`` and text parts (paths relative
to the JSONL file), formatted by the directory's HF processor (``longspan.data.sft.multimodal``)::

    longspan finetune --recipe vlm-lora checkpoint.pretrained_checkpoint=HF_DIR dataset.dataset_root=DATA_DIR

``vlm-lora`` adapts the language model's linear layers (Megatron Bridge's LoRA targets); the vision encoder and
the patch merger stay frozen with the rest of the base. ``vlm-sft`` trains every parameter (set
``model.freeze_vision_model`` / ``model.freeze_vision_projection`` / ``model.freeze_language_model`` to keep parts
as they are). Layouts: FSDP2 and tensor parallel (the vision encoder and its projection are replicated on every
tensor-parallel rank; the language model is split). Conversations without an image may be mixed in under any
layout (a training microbatch without one runs the encoder on a blank image times 0). Packing: set
``dataset.packed_sequence_specs.packed_sequence_size`` to ``model.seq_length`` (``longspan.data.sft.multimodal_packing``).
"""

from __future__ import annotations

from longspan.families.qwen_vl.provider import Qwen25VLModelProvider
from longspan.peft import LoRA
from longspan.recipes.finetune import finetune_recipe
from longspan.training.config import ConfigContainer

SEQ_LENGTH = 2048


def _placeholder_model() -> Qwen25VLModelProvider:
    """A tiny Qwen2.5-VL, replaced by the pretrained checkpoint's family and architecture at start-up (only the
    layout, precision, sequence length and the fields set on purpose are kept); it makes the recipe validate as
    it is."""
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
              "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 56, "fullatt_block_indexes": [0],
              "out_hidden_size": 32}
    return Qwen25VLModelProvider(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                                 num_query_groups=2, vocab_size=128, seq_length=SEQ_LENGTH, mrope_section=[2, 1, 1],
                                 vision_config=vision)


def _vlm_recipe(name: str, lr: float) -> ConfigContainer:
    cfg = finetune_recipe(name, lr)
    cfg.model = _placeholder_model()
    return cfg


def vlm_sft() -> ConfigContainer:
    """Full-parameter finetuning of a pretrained vision-language model on image-and-text chats (lr 5e-6)."""
    return _vlm_recipe("vlm-sft", lr=5e-6)


def vlm_lora() -> ConfigContainer:
    """LoRA (rank 32, alpha 32, on linear_qkv/proj/fc1/fc2 of the language model) on a frozen vision-language
    model (lr 1e-4)."""
    cfg = _vlm_recipe("vlm-lora", lr=1e-4)
    cfg.peft = LoRA()
    return cfg
