"""GPT-OSS (``GptOssForCausalLM``): a mixture-of-experts decoder with attention sinks."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.gpt_oss.hf import GPT_OSS

register_family(GPT_OSS)
