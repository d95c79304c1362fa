"""Hugging Face models in and out of longspan: ``AutoBridge`` (Megatron Bridge's method names), one declarative
table per HF family (``families`` + ``mapping``), safetensors read and written by slice.

May import core, config, models, data, parallel and peft; never training (its checkpoint format reaches
``AutoBridge.import_ckpt`` / ``export_ckpt`` through ``checkpoints.CheckpointFormat``).
"""

from longspan.conversion.bridge import AutoBridge, hf_pretrained_dir, is_hf_model_dir, read_hf_config

__all__ = ["AutoBridge", "hf_pretrained_dir", "is_hf_model_dir", "read_hf_config"]
