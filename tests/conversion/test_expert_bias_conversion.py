"""The aux-loss-free routing bias through conversion: HF's ``mlp.gate.e_score_correction_bias`` is longspan's float32
buffer ``router.expert_bias`` (a ``WeightMap`` entry flagged ``buffer``). Imported and exported bit-exactly, and
a router with random non-zero biases chooses the experts, with the weights, transformers' router chooses."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from longspan import AutoBridge
from longspan.conversion import mapping
from longspan.conversion.loader import export_hf_weights, load_hf_weights
from longspan.conversion.safetensors_io import HFCheckpointReader
from longspan.core.errors import CheckpointError
from longspan.families.glm.hf import WEIGHTS as GLM_WEIGHTS
from tests.conversion.glm_models import make_glm_model
from tests.conversion.parity import tensors

BIAS = "model.layers.{}.mlp.gate.e_score_correction_bias"


def _router(chunk, layer: int):
    return chunk.get_submodule(f"decoder.layers.{layer}.mlp.router")


def test_table_flags_the_bias_as_a_buffer():
    entry, layer = mapping.match(GLM_WEIGHTS, "decoder.layers.7.mlp.router.expert_bias")
    assert entry.buffer and layer == 7 and entry.hf_name(layer) == BIAS.format(7)
    assert not any(e.buffer for e in GLM_WEIGHTS if e is not entry)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_is_imported_and_exported_bit_exactly(tmp_path, dtype):
    src, out = tmp_path / "hf", tmp_path / "out"
    make_glm_model(src, tokenizer=False, dtype=dtype)
    source = tensors(src)
    bridge = AutoBridge.from_hf_pretrained(src)
    model = bridge.to_megatron_model()
    for layer in (1, 2):
        bias = _router(model[0], layer).expert_bias
        assert bias.dtype == torch.float32  # the buffer stays float32 in any model dtype
        assert torch.equal(bias, source[BIAS.format(layer)].float())
        assert bias.abs().min() > 0
    exported = dict(bridge.export_hf_weights(model))
    for layer in (1, 2):
        assert exported[BIAS.format(layer)].dtype == torch.float32
        assert torch.equal(exported[BIAS.format(layer)], source[BIAS.format(layer)].float())
    assert "model.layers.0.mlp.gate.e_score_correction_bias" not in exported  # the dense layer has none


def test_router_chooses_the_experts_transformers_chooses(tmp_path):
    """Router by router on the same hidden states: the chosen experts and their weights equal transformers'
    Glm4MoeTopkRouter's; with the bias dropped the choice changes."""
    src = tmp_path / "hf"
    hf = make_glm_model(src, tokenizer=False)
    model = AutoBridge.from_hf_pretrained(src).to_megatron_model()
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    for layer in (1, 2):
        ours = _router(model[0], layer).eval()
        with torch.no_grad():
            _, weights, indices = hf.model.layers[layer].mlp.gate(x)
            probs, routing_map = ours(x)
        expected = torch.zeros(64, 8).scatter(1, indices, weights)
        assert torch.equal(routing_map, expected > 0)
        assert (probs - expected).abs().max().item() <= 1e-6
        saved = ours.expert_bias.clone()
        ours.expert_bias.zero_()
        with torch.no_grad():
            unbiased_map = ours(x)[1]
        ours.expert_bias.copy_(saved)
        assert not torch.equal(unbiased_map, routing_map)


def test_a_table_without_the_bias_entry_fails_in_one_line(tmp_path):
    """A family that cannot hold the routing bias refuses the model on import and export (never drops it)."""
    src = tmp_path / "hf"
    make_glm_model(src, tokenizer=False)
    bridge = AutoBridge.from_hf_pretrained(src)
    model = bridge.to_megatron_model()
    without = replace(bridge.family, weights=tuple(e for e in GLM_WEIGHTS if not e.buffer))
    with pytest.raises(CheckpointError, match=r"buffer decoder\.layers\.1\.mlp\.router\.expert_bias has no") as info:
        list(export_hf_weights(model, without, hf_vocab=None, tied=False))
    assert "\n" not in str(info.value)
    reader = HFCheckpointReader(src)
    try:
        with pytest.raises(CheckpointError, match="expert_bias has no Glm4MoeForCausalLM equivalent"):
            load_hf_weights(model, without, reader, hf_vocab=None)
    finally:
        reader.close()
