"""Data: tokenizers, megatron-core's ``.bin/.idx`` indexed datasets and their preprocessing, GPT, mock,
blended and T5 span datasets, samplers and data loaders, the built-in corpus, and supervised finetuning data
(``sft/``).

May import: core, config, models (its own layer).
"""
