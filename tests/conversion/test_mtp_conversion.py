"""Multi-token-prediction (MTP) layers of DeepSeek-V3 and GLM-4.5 HF checkpoints through AutoBridge.

The checkpoints are tiny random models saved by transformers (which writes no MTP tensors) with one MTP layer
added to their safetensors as ``model.layers.{num_hidden_layers}.*``: random tensors shaped like the last decoder
layer's, its own norms and projection, and copies of the embedding and output head. Checked:

- the import sets ``mtp_num_layers`` from ``num_nextn_predict_layers`` and ``mtp.layers.0`` holds exactly those
  tensors (a hand-written name table, not longspan's);
- the main logits equal transformers' and the MTP depth's output equals transformers' ``MtpModel`` (fp32, 1e-5);
- import -> export is bit-identical, key set included, with ``num_nextn_predict_layers`` in config.json;
- an embedding / head copy that differs from the shared tensor, a model asking for more depths than the files
  hold: one-line errors; ``mtp_num_layers=None``, a checkpoint without MTP tensors: skipped with one log line;
- a last pipeline stage's embedding copy (MTP's) is exported once, by the first stage.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from longspan import AutoBridge
from longspan.core.errors import CheckpointError
from longspan.models.mtp import roll_left
from tests.conversion.glm_models import make_glm_model
from tests.conversion.parity import hf_logits, load_hf, read_config, tensors
from tests.conversion.test_deepseek_moe import save_random_deepseek_moe

EXPERTS = 8
# HF name inside an MTP layer -> longspan name inside mtp.layers.0 (written out here, independent of longspan's
# tables); routed experts are handled apart (one HF tensor per expert, one longspan slab).
MTP_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "final_layernorm.weight",
    "input_layernorm.weight": "transformer_layer.input_layernorm.weight",
    "post_attention_layernorm.weight": "transformer_layer.pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "transformer_layer.self_attention.linear_proj.weight",
    "mlp.gate.weight": "transformer_layer.mlp.router.weight",
    "mlp.gate.e_score_correction_bias": "transformer_layer.mlp.router.expert_bias",
    "mlp.shared_experts.gate_proj.weight": "transformer_layer.mlp.shared_experts.linear_fc1_gate.weight",
    "mlp.shared_experts.up_proj.weight": "transformer_layer.mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.down_proj.weight": "transformer_layer.mlp.shared_experts.linear_fc2.weight",
}
MLA_NAMES = {
    "self_attn.q_a_proj.weight": "linear_q_down_proj.weight",
    "self_attn.q_a_layernorm.weight": "q_layernorm.weight",
    "self_attn.q_b_proj.weight": "linear_q_up_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight",
    "self_attn.kv_a_layernorm.weight": "kv_layernorm.weight",
    "self_attn.kv_b_proj.weight": "linear_kv_up_proj.weight",
}
GQA_NAMES = {f"self_attn.{hf}_proj.{kind}": f"linear_{hf}.{kind}" for hf in "qkv" for kind in ("weight", "bias")}
GQA_NAMES.update({"self_attn.q_norm.weight": "q_layernorm.weight", "self_attn.k_norm.weight": "k_layernorm.weight"})
EXPERT_NAMES = {"gate_proj": "linear_fc1_gate", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def add_mtp_layer(directory: Path, seed: int = 7) -> dict[str, torch.Tensor]:
    """Add MTP depth 0 to ``directory``'s safetensors (config.json must declare it); returns the added tensors."""
    cfg = read_config(directory)
    hidden, first = cfg["hidden_size"], cfg["num_hidden_layers"]
    weights = load_file(str(directory / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{first - 1}.", f"model.layers.{first}."
    added = {}
    for name, t in weights.items():
        if not name.startswith(last):
            continue
        rest = name[len(last):]
        if "norm" in rest:
            value = torch.rand(t.shape, generator=g) + 0.5
        elif rest.endswith("e_score_correction_bias"):
            value = torch.rand(t.shape, generator=g) - 0.5
        elif rest == "mlp.gate.weight":  # spread router scores: no ties
            value = torch.randn(t.shape, generator=g)
        else:
            value = torch.randn(t.shape, generator=g) * 0.1
        added[mtp + rest] = value.to(t.dtype)
    for rest in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        added[mtp + rest] = torch.rand(hidden, generator=g) + 0.5
    added[mtp + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
    head = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    added[mtp + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    added[mtp + "shared_head.head.weight"] = weights[head].clone()
    save_file({**weights, **added}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return added


def make_source(kind: str, directory: Path):
    """A random HF model of ``kind`` with one MTP layer added; returns (transformers model, added tensors)."""
    if kind == "glm4_moe":
        hf = make_glm_model(directory, tokenizer=False)
    else:
        hf = save_random_deepseek_moe(directory, 24, num_nextn_predict_layers=1,
                                      tie_word_embeddings=kind == "deepseek_v3_tied")
    assert read_config(directory)["num_nextn_predict_layers"] == 1
    return hf, add_mtp_layer(directory)


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v3_tied", "glm4_moe"])
def imported(request, tmp_path_factory):
    src = tmp_path_factory.mktemp(request.param) / "hf"
    hf, added = make_source(request.param, src)
    bridge = AutoBridge.from_hf_pretrained(src)
    return request.param, src, hf, added, bridge, bridge.to_megatron_model()


def _expected_mtp_state(kind: str, added: dict[str, torch.Tensor], first: int) -> dict[str, torch.Tensor]:
    attention = GQA_NAMES if kind == "glm4_moe" else MLA_NAMES
    names = {**MTP_NAMES, **{hf: f"transformer_layer.self_attention.{ours}" for hf, ours in attention.items()}}
    expected: dict[str, torch.Tensor] = {}
    experts: dict[str, list] = {}
    for name, tensor in added.items():
        rest = name[len(f"model.layers.{first}."):]
        if rest in COPIES:
            continue
        if rest.startswith("mlp.experts."):
            _, _, e, proj, _ = rest.split(".")
            experts.setdefault(EXPERT_NAMES[proj], [None] * EXPERTS)[int(e)] = tensor
            continue
        expected[f"mtp.layers.0.{names[rest]}"] = tensor
    for ours, slabs in experts.items():
        expected[f"mtp.layers.0.transformer_layer.mlp.experts.{ours}.weight"] = torch.stack(slabs)
    return expected


def test_import_sets_the_depths_and_the_mtp_modules_hold_exactly_the_checkpoint_tensors(imported):
    kind, src, _, added, bridge, model = imported
    provider = bridge.to_megatron_provider(load_weights=False)
    assert provider.mtp_num_layers == 1
    assert provider.mtp_loss_scaling_factor == (0.3 if kind == "glm4_moe" else 0.1)  # Megatron Bridge's choices
    state = {**dict(model[0].named_parameters()), **dict(model[0].named_buffers())}
    ours = {name: t for name, t in state.items() if name.startswith("mtp.")}
    expected = _expected_mtp_state(kind, added, read_config(src)["num_hidden_layers"])
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


def _transformers_mtp_depth(hf, src: Path, added: dict[str, torch.Tensor]):
    """transformers' MtpModel for ``hf`` holding the added MTP layer (its own names: ``layers.0.mtp_block.*``,
    ``post_norm``, fused ``gate_up_proj`` / ``down_proj`` expert slabs)."""
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(hf, 1).float().eval()
    first = read_config(src)["num_hidden_layers"]
    state, experts = {}, {}
    for name, tensor in added.items():
        rest = name[len(f"model.layers.{first}."):]
        if rest in COPIES:
            continue
        if rest.startswith("mlp.experts."):
            _, _, e, proj, _ = rest.split(".")
            experts.setdefault(proj, [None] * EXPERTS)[int(e)] = tensor
        elif rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
            state[f"layers.0.{rest}"] = tensor
        elif rest == "shared_head.norm.weight":
            state["layers.0.post_norm.weight"] = tensor
        else:
            state[f"layers.0.mtp_block.{rest}"] = tensor
    prefix = "layers.0.mtp_block.mlp.experts."
    state[prefix + "gate_up_proj"] = torch.cat([torch.stack(experts["gate_proj"]), torch.stack(experts["up_proj"])], 1)
    state[prefix + "down_proj"] = torch.stack(experts["down_proj"])
    result = mtp.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"embed_tokens.weight", "shared_head.weight"}
    return mtp


def test_main_logits_and_the_mtp_depth_equal_transformers(imported):
    """The MTP depth reads the decoder's normed output and the next token's embedding; transformers' MtpModel
    (speculative decoding) computes the same hidden states and logits."""
    _, src, hf, added, _, model = imported
    tokens = torch.randint(0, 96, (2, 14), generator=torch.Generator().manual_seed(0))
    ours_model = model[0].eval()
    with torch.no_grad():
        out = hf(input_ids=tokens, output_hidden_states=True)
        assert (ours_model(tokens) - out.logits).abs().max().item() <= 1e-5
        mtp = _transformers_mtp_depth(hf, src, added)
        positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
        reference = mtp.forward_layer(0, out.hidden_states[-1], positions, None, input_ids=roll_left(tokens))
        seen = []
        hook = ours_model.mtp.layers[0].register_forward_hook(lambda m, a, o: seen.append(o))
        try:
            ours_model(tokens, labels=tokens)
        finally:
            hook.remove()
        assert reference.abs().max() > 0.1
        assert (seen[0] - reference).abs().max().item() <= 1e-5
        head = ours_model.output_layer or ours_model.embedding.word_embeddings  # the shared head (or tied embedding)
        ours_logits = torch.nn.functional.linear(seen[0], head.weight)
        assert (ours_logits - mtp._project_to_logits(reference)).abs().max().item() <= 1e-5


def test_export_is_bit_identical_with_the_mtp_layer(imported, tmp_path):
    _, src, _, added, bridge, model = imported
    bridge.save_hf_pretrained(model, tmp_path / "out")
    original, exported = tensors(src), tensors(tmp_path / "out")
    assert set(added) <= set(exported) and sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert read_config(tmp_path / "out")["num_nextn_predict_layers"] == 1
    # the provider alone (no imported config.json) writes the same tensors and declares the layer too
    fresh = AutoBridge.from_longspan_provider(bridge.to_megatron_provider(load_weights=False))
    fresh.save_hf_pretrained(model, tmp_path / "fresh")
    again = tensors(tmp_path / "fresh")
    assert sorted(again) == sorted(original) and all(torch.equal(again[n], t) for n, t in original.items())
    assert read_config(tmp_path / "fresh")["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize("copy", sorted(COPIES))
def test_a_copy_that_differs_from_the_shared_tensor_fails_in_one_line(tmp_path, copy):
    src = tmp_path / "hf"
    make_source("deepseek_v3", src)
    weights = load_file(str(src / "model.safetensors"))
    name = f"model.layers.3.{copy}"
    weights[name] = weights[name].clone()
    weights[name][5, 3] += 0.25
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        AutoBridge.from_hf_pretrained(src).to_megatron_model()
    message = str(info.value)
    assert f"HF tensor {name} differs from {COPIES[copy]}" in message and "0.25" in message and "\n" not in message


def test_mtp_num_layers_none_skips_the_layer_with_one_log_line(tmp_path, caplog):
    src = tmp_path / "hf"
    hf, _ = make_source("deepseek_v3", src)
    provider = AutoBridge.from_hf_pretrained(src).to_megatron_provider()
    provider.mtp_num_layers = None
    with caplog.at_level(logging.INFO, logger="longspan"):
        model = provider.provide_distributed_model()
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(lines) == 1 and "model.layers.3..3" in lines[0] and "mtp_num_layers=None" in lines[0], lines
    assert model[0].mtp is None
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    assert (model[0].eval()(tokens) - hf_logits(hf, tokens)).abs().max().item() <= 1e-5
    out = tmp_path / "out"
    AutoBridge.from_hf_pretrained(src).save_hf_pretrained(model, out)
    assert not any(n.startswith("model.layers.3.") for n in tensors(out))
    assert read_config(out)["num_nextn_predict_layers"] == 0
    assert torch.equal(hf_logits(load_hf(out), tokens), hf_logits(load_hf(src), tokens))


def test_more_depths_than_the_checkpoint_holds_fail_in_one_line(tmp_path):
    src = tmp_path / "hf"
    make_source("glm4_moe", src)
    provider = AutoBridge.from_hf_pretrained(src).to_megatron_provider()
    provider.mtp_num_layers = 2
    with pytest.raises(CheckpointError) as info:
        provider.provide_distributed_model()
    message = str(info.value)
    assert "model.mtp_num_layers=2" in message and "holds (1;" in message and "\n" not in message


def test_a_checkpoint_saved_by_transformers_imports_without_mtp(tmp_path, caplog):
    """transformers keeps num_nextn_predict_layers in config.json but writes no MTP tensors: one log line, and
    the model has no depths (so it loads and exports like any checkpoint)."""
    src = tmp_path / "hf"
    save_random_deepseek_moe(src, 24, num_nextn_predict_layers=1)
    with caplog.at_level(logging.INFO, logger="longspan"):
        provider = AutoBridge.from_hf_pretrained(src).to_megatron_provider(load_weights=False)
    lines = [r.getMessage() for r in caplog.records if "num_nextn_predict_layers=1" in r.getMessage()]
    assert len(lines) == 1 and "mtp_num_layers=None" in lines[0] and "model.layers.3.eh_proj.weight" in lines[0]
    assert provider.mtp_num_layers is None


def test_a_last_pipeline_stage_embedding_copy_is_exported_once(tmp_path):
    """Two pipeline chunks on one process (the last with MTP's own embedding copy): the load fills both
    embeddings, the export writes each HF tensor once."""
    from longspan.models.gpt import build_gpt_model

    src = tmp_path / "hf"
    make_source("deepseek_v3", src)
    bridge = AutoBridge.from_hf_pretrained(src)
    provider = bridge.to_megatron_provider(load_weights=False)
    chunks = [build_gpt_model(provider, pre_process=True, post_process=False, layer_numbers=[0, 1], device="cpu"),
              build_gpt_model(provider, pre_process=False, post_process=True, layer_numbers=[2], device="cpu")]
    assert chunks[1].embedding is not None and chunks[1].mtp is not None
    bridge.load_weights_into(chunks)
    assert torch.equal(chunks[0].embedding.word_embeddings.weight, chunks[1].embedding.word_embeddings.weight)
    names = [name for name, _ in bridge.export_hf_weights(chunks)]
    assert len(names) == len(set(names)) and sorted(names) == sorted(tensors(src))


@pytest.mark.parametrize("depths", [None, 1])
def test_training_from_the_hf_directory_keeps_the_recipes_mtp_choice(tmp_path, depths):
    """checkpoint.pretrained_checkpoint: the architecture comes from config.json, whether to train the MTP
    layers from the recipe (they load when it asks for them, else are skipped with one log line)."""
    from longspan.recipes import get_recipe
    from longspan.training.checkpointing.hf_weights import apply_hf_model_config

    src = tmp_path / "hf"
    make_source("glm4_moe", src)
    cfg = get_recipe("tiny")
    cfg.model.mtp_num_layers, cfg.model.mtp_loss_scaling_factor = depths, 0.2
    changed = apply_hf_model_config(cfg, src)
    assert "num_moe_experts" in changed and not {"mtp_num_layers", "mtp_loss_scaling_factor"} & set(changed)
    assert (cfg.model.mtp_num_layers, cfg.model.mtp_loss_scaling_factor) == (depths, 0.2)
