"""Vision-language models: vision encoders as plain modules feeding longspan's GPT language model.

Qwen2.5-VL (``Qwen25VLModelProvider`` -> ``qwen25_vl.Qwen25VLModel``): ``qwen_vision`` (ViT with window
attention and 2-D RoPE, patch merger), ``mrope`` (multimodal RoPE and its position ids). Shared pieces other
vision-language models can use: ``GPTModel.forward(decoder_input=...)`` (embeddings computed by the caller,
e.g. with image embeddings put in) and ``qwen25_vl.freeze`` (the freeze options' pattern).

Importing this package loads the providers only; the model code loads when a model is built.
"""

from __future__ import annotations

from longspan.models.vlm.qwen25_vl_provider import Qwen25VLModelProvider

__all__ = ["Qwen25VLModelProvider"]
