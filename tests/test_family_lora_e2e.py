"""LoRA finetunes from the `longspan` command of a tiny random Gemma 4 and a tiny random Nemotron 3 (each the shape
of its conversion test, with the chat tokenizer's vocabulary): `longspan generate --hf-model` continues the base
as transformers does, the finetune on packed chat data lowers the validation loss, and the merged export loads in
transformers and generates what longspan generates from it.

Gemma 4 (the ``gemma4`` recipe): KV-shared layers, keys as values on the full layers, per-layer inputs, windows
shorter than the packed sequence; adapters on attention and on every MLP (the double-wide ones included).
Nemotron 3 (the ``nemotron3-nano-lora`` recipe): Mamba-2, attention, dense MLP and latent MoE layers; adapters on
the Mamba-2 mixers' ``in_proj`` and ``out_proj``, attention, the dense MLP, the shared expert and each routed
expert (Bridge's targets). The latent projections get none: longspan has no LoRA for them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.conversion.test_gemma4 import save_gemma4
from tests.conversion.test_nemotron3 import SHAPE as NEMOTRON3_SHAPE
from tests.helpers.chat_lora import EOS_ID, PAD_ID, VOCAB, adapted_modules, chat_lora_finetune, save_chat_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

IDS = dict(vocab_size=VOCAB, pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=None)


def _gemma4(directory: Path) -> None:
    save_gemma4(directory, vocab_size_per_layer_input=VOCAB + 7, initializer_range=0.2, **IDS)


def _nemotron3(directory: Path) -> None:
    torch.manual_seed(0)
    config = transformers.NemotronHConfig(**dict(NEMOTRON3_SHAPE, initializer_range=0.2, **IDS))
    transformers.NemotronHForCausalLM(config).float().save_pretrained(str(directory))


# family: (make the HF model, recipe, its overrides for one process, module names that must hold adapters, names
# that must not)
FAMILIES = {
    "gemma4": (_gemma4, "gemma4", [],
               {"decoder.layers.0.self_attention.linear_v", "decoder.layers.1.self_attention.linear_k",
                "decoder.layers.4.self_attention.linear_q", "decoder.layers.4.self_attention.linear_proj",
                "decoder.layers.5.mlp.linear_fc1", "decoder.layers.5.mlp.linear_fc1_gate",
                "decoder.layers.5.mlp.linear_fc2"},
               set()),
    # layers M, E, *, -, E, M
    "nemotron3": (_nemotron3, "nemotron3-nano-lora", ["model.expert_model_parallel_size=1"],
                  {"decoder.layers.2.self_attention.linear_q", "decoder.layers.2.self_attention.linear_proj",
                   "decoder.layers.3.mlp.linear_fc1", "decoder.layers.1.mlp.shared_experts.linear_fc2",
                   "decoder.layers.4.mlp.experts.linear_fc1", "decoder.layers.4.mlp.experts.linear_fc2",
                   "decoder.layers.0.mixer.in_proj.z", "decoder.layers.0.mixer.in_proj.dt",
                   "decoder.layers.5.mixer.out_proj"},
                  {"decoder.layers.1.mlp.fc1_latent_proj"}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_finetune_from_the_cli(family: str, tmp_path: Path) -> None:
    make, recipe, overrides, adapted, not_adapted = FAMILIES[family]
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    make(hf_dir)
    save_chat_tokenizer(hf_dir)
    run = chat_lora_finetune(tmp_path, hf_dir, recipe, overrides)
    stored = adapted_modules(run)
    assert adapted <= stored, sorted(adapted - stored)
    assert not any(name.startswith(tuple(not_adapted)) for name in stored), sorted(stored)
