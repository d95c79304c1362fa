"""The ``moe-lora`` recipe end to end through the `longspan` command: a LoRA finetune of a tiny random GLM-4.5 MoE
(partial RoPE, routing biases, group-limited routing, a shared expert, a dense first layer) straight from its HF
directory, with adapters on attention and on the routed and shared experts; the validation loss falls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longspan import AutoBridge
from longspan.peft.adapters import apply_adapters, grouped_adapted_layers
from longspan.peft.modules import LoRALinear
from longspan.recipes import get_recipe
from tests.conversion.glm_models import make_glm_model
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
