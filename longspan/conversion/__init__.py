"""Hugging Face models in and out of longspan (``AutoBridge``), with Megatron Bridge's method names:
one declarative mapping table per HF family, safetensors streamed by slice.

May import: core, config, models, data, parallel.
"""

from longspan.conversion.bridge import AutoBridge, is_hf_model_dir, read_hf_config

__all__ = ["AutoBridge", "is_hf_model_dir", "read_hf_config"]
