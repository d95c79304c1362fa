"""End to end through the `longspan` command with a tiny random Gemma 3 (sliding-window layers shorter than the
prompts, local/global RoPE bases, zero-centred sandwich norms, tied embeddings): LoRA finetune from the HF
directory -> the loss falls -> merged HF export that transformers loads and that generates what longspan does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from tests.test_finetune_e2e import _char_tokenizer, _hf_completion_loss, _reverse_words, _run, _run_here

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WINDOW = 4


def _gemma3_base(directory: Path) -> None:
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
    cfg = transformers.Gemma3TextConfig(
        vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=64,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=rope, pad_token_id=2, eos_token_id=1, bos_token_id=None, tie_word_embeddings=True)
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(str(directory))
    _char_tokenizer(directory)


def test_lora_finetune_of_gemma3_from_the_cli(tmp_path: Path) -> None:
    hf_dir, data, out = tmp_path / "hf", tmp_path / "data", tmp_path / "run"
    hf_dir.mkdir()
    data.mkdir()
    _gemma3_base(hf_dir)
    _reverse_words(data / "training.jsonl", 1000, seed=1)
    _reverse_words(data / "validation.jsonl", 64, seed=2)

    before = _hf_completion_loss(hf_dir, data / "validation.jsonl")
    _run(["finetune", "--recipe", "lora", f"checkpoint.pretrained_checkpoint={hf_dir}",
          f"dataset.dataset_root={data}", f"checkpoint.save={out}", f"checkpoint.load={out}",
          f"logger.tensorboard_dir={out}/tb", "checkpoint.save_interval=150", "model.seq_length=16",
          "train.train_iters=150", "train.eval_interval=50", "train.eval_iters=4", "train.global_batch_size=16",
          "train.micro_batch_size=16", "optimizer.lr=5e-3", "scheduler.lr_warmup_iters=10", "peft.dim=16",
          "peft.alpha=32"], cwd=tmp_path)

    records = [json.loads(x) for x in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["losses"]["lm loss"] for r in records if r.get("phase") == "validation"]
    assert len(valid) == 3, records[-3:]
    # The base model starts near ln(16) per token; 150 steps bring it below letter frequencies' ln(8) ~ 2.08.
    assert valid[-1] < valid[1] < valid[0] < before and valid[-1] < 0.8 * before, (before, valid)

    # HF model out (adapters merged): transformers loads it and answers as longspan's generate does, with a
    # prompt longer than the window.
    export = tmp_path / "export"
    _run_here(["convert", "export", "--checkpoint", str(out), "--output", str(export)], cwd=tmp_path)
    assert json.loads((export / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(export), attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
    prompt = "abcdh= "
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] > WINDOW
    hf_ids = merged.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=2)[0].tolist()
    gen = _run_here(["generate", "--checkpoint", str(out), "--prompt", prompt, "--max-new-tokens", "5", "--json"],
                    cwd=tmp_path)
    ours = json.loads(gen.strip().splitlines()[-1])
    assert ours["prompt_ids"] == ids[0].tolist()
    assert ours["output_ids"] == hf_ids[len(ours["prompt_ids"]):][: len(ours["output_ids"])]
    assert len(ours["output_ids"]) >= 3  # the finetuned model answers (does not stop at once)
