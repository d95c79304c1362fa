"""Hugging Face models in and out of longspan (``AutoBridge``), with Megatron Bridge's method names."""

from longspan.conversion.bridge import AutoBridge, is_hf_model_dir, read_hf_config

__all__ = ["AutoBridge", "is_hf_model_dir", "read_hf_config"]
