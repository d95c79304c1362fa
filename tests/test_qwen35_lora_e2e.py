"""End to end through the `longspan` command with a tiny random Qwen3.5 (three gated DeltaNet layers to one gated
attention layer): `longspan generate --hf-model` continues the HF directory as transformers does; the `qwen35`
recipe's LoRA finetune (adapters on the DeltaNet projections too) on packed chat data lowers the validation
loss; the merged HF export loads in transformers and generates what `longspan generate --hf-model` does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.helpers.chat_lora import EOS_ID, PAD_ID, VOCAB, adapted_modules, chat_lora_finetune, save_chat_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _qwen35_base(directory: Path) -> None:
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=64, tie_word_embeddings=True,
        layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=PAD_ID, eos_token_id=EOS_ID,
        bos_token_id=None, initializer_range=0.2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(cfg).float().save_pretrained(str(directory))
    save_chat_tokenizer(directory)


def test_lora_finetune_of_qwen35_on_packed_chat_data_from_the_cli(tmp_path: Path) -> None:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    _qwen35_base(hf_dir)
    run = chat_lora_finetune(tmp_path, hf_dir, "qwen35", [])
    # the recipe adapts the DeltaNet layers (0-2) too: the adapter-only checkpoint holds their adapters
    adapted = adapted_modules(run)
    assert {"decoder.layers.0.self_attention.linear_z", "decoder.layers.2.self_attention.linear_proj"} <= adapted, \
        sorted(adapted)
