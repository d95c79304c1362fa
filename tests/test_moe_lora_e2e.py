"""The ``moe-lora`` recipe end to end through the `longspan` command: a LoRA finetune of a tiny random GLM-4.5 MoE
(partial RoPE, routing biases, group-limited routing, a shared expert, a dense first layer) straight from its HF
directory, with adapters on attention and on the routed and shared experts; the validation loss falls. The same
for a tiny random DeepSeek-V3 (multi-latent attention with query compression): adapters on every MLA projection
and every expert with no extra flags, the loss falls, and the adapter checkpoint keeps the moving routing bias."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import torch
import torch.distributed.checkpoint as dcp

from longspan import AutoBridge
from longspan.peft.adapters import apply_adapters, grouped_adapted_layers
from longspan.peft.modules import LoRALinear
from longspan.recipes import get_recipe
from tests.conversion.glm_models import make_glm_model
from tests.conversion.test_deepseek_moe import save_random_deepseek_moe
from tests.test_finetune_e2e import _char_tokenizer, _hf_completion_loss, _reverse_words, _run


def test_recipe_adapts_attention_and_every_expert(tmp_path: Path) -> None:
    """On a GLM-4.5 model: adapters on attention, the dense MLP, the shared experts and (per expert) the routed
    experts; routers and every base weight frozen."""
    cfg = get_recipe("moe-lora")
    assert cfg.checkpoint.pretrained_checkpoint is None  # given on the command line
    make_glm_model(tmp_path / "hf", tokenizer=False)
    model = AutoBridge.from_hf_pretrained(tmp_path / "hf").to_megatron_model()[0]
    apply_adapters(model, cfg.peft)
    wrapped = {name for name, module in model.named_modules() if isinstance(module, LoRALinear)}
    grouped = {name for name, _ in grouped_adapted_layers(model)}
    for layer in (1, 2):
        assert f"decoder.layers.{layer}.self_attention.linear_q" in wrapped
        assert f"decoder.layers.{layer}.self_attention.linear_proj" in wrapped
        assert f"decoder.layers.{layer}.mlp.shared_experts.linear_fc2" in wrapped
        assert {f"decoder.layers.{layer}.mlp.experts.linear_fc1", f"decoder.layers.{layer}.mlp.experts.linear_fc2",
                f"decoder.layers.{layer}.mlp.experts.linear_fc1_gate"} <= grouped
    assert "decoder.layers.0.mlp.linear_fc1" in wrapped  # the dense first layer
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("adapter" in name for name in trainable)
    assert not any("router" in name for name in trainable)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_finetune_of_glm_from_the_cli(tmp_path: Path) -> None:
    hf_dir, data, out = tmp_path / "hf", tmp_path / "data", tmp_path / "run"
    make_glm_model(hf_dir, tokenizer=False, vocab_size=16, hidden_size=64, head_dim=16, eos_token_id=1,
                   pad_token_id=2)
    _char_tokenizer(hf_dir)
    data.mkdir()
    _reverse_words(data / "training.jsonl", 1000, seed=1)
    _reverse_words(data / "validation.jsonl", 64, seed=2)

    before = _hf_completion_loss(hf_dir, data / "validation.jsonl")
    result = _run(["finetune", "--recipe", "moe-lora", f"checkpoint.pretrained_checkpoint={hf_dir}",
                   f"dataset.dataset_root={data}", f"checkpoint.save={out}", f"checkpoint.load={out}",
                   f"logger.tensorboard_dir={out}/tb", "checkpoint.save_interval=60", "model.seq_length=16",
                   "train.train_iters=60", "train.eval_interval=20", "train.eval_iters=4",
                   "train.global_batch_size=16", "train.micro_batch_size=16", "optimizer.lr=5e-3",
                   "scheduler.lr_warmup_iters=5", "peft.dim=8", "peft.alpha=16"], cwd=tmp_path)
    assert "peft: LoRA" in result.stdout + result.stderr

    records = [json.loads(x) for x in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["losses"]["lm loss"] for r in records if r.get("phase") == "validation"]
    assert len(valid) == 3, records[-3:]
    assert valid[-1] < valid[0] < before * 1.05 and valid[-1] < 0.85 * before, (before, valid)


MLA_PROJECTIONS = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")


def test_recipe_adapts_every_mla_projection_and_expert_of_deepseek(tmp_path: Path) -> None:
    """DeepSeek-V3 (q_lora_rank set): the recipe's targets cover multi-latent attention's projections with no extra
    flags, next to the dense first layer, the shared expert and every routed expert; the routers stay frozen."""
    save_random_deepseek_moe(tmp_path / "hf", q_lora_rank=24)
    model = AutoBridge.from_hf_pretrained(tmp_path / "hf").to_megatron_model()[0]
    apply_adapters(model, get_recipe("moe-lora").peft)
    wrapped = {name for name, module in model.named_modules() if isinstance(module, LoRALinear)}
    grouped = {name for name, _ in grouped_adapted_layers(model)}
    for layer in (0, 1, 2):
        assert {f"decoder.layers.{layer}.self_attention.{p}" for p in MLA_PROJECTIONS} <= wrapped
    for layer in (1, 2):
        assert f"decoder.layers.{layer}.mlp.shared_experts.linear_fc1" in wrapped
        assert {f"decoder.layers.{layer}.mlp.experts.{p}" for p in ("linear_fc1", "linear_fc1_gate", "linear_fc2")} \
            <= grouped
    assert "decoder.layers.0.mlp.linear_fc2" in wrapped
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("adapter" in name for name in trainable)


def _checkpoint_keys(directory: Path) -> set[str]:
    return set(dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_finetune_of_deepseek_v3_from_the_cli(tmp_path: Path) -> None:
    hf_dir, data, out = tmp_path / "hf", tmp_path / "data", tmp_path / "run"
    hf = save_random_deepseek_moe(hf_dir, q_lora_rank=24, vocab_size=16, eos_token_id=1, pad_token_id=2,
                                  bos_token_id=0)
    pretrained_bias = {layer: hf.model.layers[layer].mlp.gate.e_score_correction_bias.detach().clone()
                       for layer in (1, 2)}
    _char_tokenizer(hf_dir)
    data.mkdir()
    _reverse_words(data / "training.jsonl", 400, seed=1)
    _reverse_words(data / "validation.jsonl", 32, seed=2)
    iters = 24
    result = _run(["finetune", "--recipe", "moe-lora", f"checkpoint.pretrained_checkpoint={hf_dir}",
                   f"dataset.dataset_root={data}", f"checkpoint.save={out}", f"checkpoint.load={out}",
                   f"logger.tensorboard_dir={out}/tb", f"checkpoint.save_interval={iters}", "model.seq_length=16",
                   f"train.train_iters={iters}", "train.eval_interval=1000", "train.eval_iters=0",
                   "train.global_batch_size=16", "train.micro_batch_size=16", "optimizer.lr=5e-3",
                   "scheduler.lr_warmup_iters=2", "peft.dim=8", "peft.alpha=16", "logger.log_interval=4",
                   "logger.log_throughput=True"], cwd=tmp_path)
    text = result.stdout + result.stderr
    assert "peft: LoRA" in text
    assert all(float(p) <= 100.0 for p in re.findall(r"MFU:? ([0-9.]+)%", text)), text[-2000:]

    records = [json.loads(x) for x in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["losses"]["lm loss"] for r in records if r.get("phase", "train") == "train"]
    assert len(losses) == iters
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.8 * first, losses

    ckpt = out / f"iter_{iters:07d}"
    keys = _checkpoint_keys(ckpt)
    for layer in (0, 1, 2):  # adapters on every MLA projection of every layer
        for proj in MLA_PROJECTIONS:
            assert f"model.decoder.layers.{layer}.self_attention.{proj}.adapter.linear_out.weight" in keys, proj
    for layer in (1, 2):  # and on the routed experts (3-D, per expert) and the shared expert
        assert f"model.decoder.layers.{layer}.mlp.experts.linear_fc1.adapter.linear_in.weight" in keys
        assert f"model.decoder.layers.{layer}.mlp.experts.linear_fc2.adapter.linear_out.weight" in keys
        assert f"model.decoder.layers.{layer}.mlp.shared_experts.linear_fc2.adapter.linear_out.weight" in keys
    assert not any(k.startswith("model.") and k.endswith(".linear_kv_up_proj.weight") for k in keys)  # no base
    # the routing bias: saved with the adapters, the pretrained values moved by at most the update rate per step
    bias_keys = [f"model.decoder.layers.{layer}.mlp.router.expert_bias" for layer in (1, 2)]
    assert set(bias_keys) <= keys
    state = {"model": {k[len("model."):]: torch.empty(8) for k in bias_keys}}
    dcp.load(state, checkpoint_id=str(ckpt))
    for layer in (1, 2):
        saved = state["model"][f"decoder.layers.{layer}.mlp.router.expert_bias"]
        moved = (saved - pretrained_bias[layer]).abs()
        assert moved.max() <= iters * 1e-3 + 1e-6 and moved.max() > 0, (saved, pretrained_bias[layer])
