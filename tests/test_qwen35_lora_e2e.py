"""End to end through the `longspan` command with a tiny random Qwen3.5 (three gated DeltaNet layers to one gated
attention layer): `longspan generate --hf-model` continues the HF directory as transformers does; the `qwen35`
recipe's LoRA finetune (adapters on the DeltaNet projections too) on packed chat data lowers the validation
loss; the merged HF export loads in transformers and generates what `longspan generate --hf-model` does."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import transformers

from tests.test_finetune_e2e import LETTERS, _char_tokenizer, _run, _run_here

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

VOCAB = 16  # the character tokenizer's 14 symbols, padded
# user turn "abc=", assistant turn "cba<eos>": the loss covers the assistant's tokens
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}={% else %}"
                 "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def _qwen35_base(directory: Path) -> None:
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=64, tie_word_embeddings=True,
        layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=2, eos_token_id=1,
        bos_token_id=None, initializer_range=0.2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(cfg).float().save_pretrained(str(directory))
    _char_tokenizer(directory)
    tokenizer_config = directory / "tokenizer_config.json"
    config = json.loads(tokenizer_config.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    tokenizer_config.write_text(json.dumps(config))


def _chat_reversals(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
        lines.append(json.dumps({"messages": [{"role": "user", "content": word},
                                              {"role": "assistant", "content": word[::-1]}]}))
    path.write_text("\n".join(lines) + "\n")


def _greedy_hf(directory: Path, prompt: str, n: int) -> tuple[list[int], list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(str(directory))(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)[0].tolist()
    return ids[0].tolist(), out[ids.shape[1]:]


def _greedy_longspan(directory: Path, prompt: str, n: int, cwd: Path) -> dict:
    printed = _run_here(["generate", "--hf-model", str(directory), "--prompt", prompt, "--max-new-tokens", str(n),
                         "--device", "cpu", "--json"], cwd=cwd)
    return json.loads(printed.strip().splitlines()[-1])


def test_lora_finetune_of_qwen35_on_packed_chat_data_from_the_cli(tmp_path: Path) -> None:
    hf_dir, data, out = tmp_path / "hf", tmp_path / "data", tmp_path / "run"
    hf_dir.mkdir()
    data.mkdir()
    _qwen35_base(hf_dir)
    _chat_reversals(data / "training.jsonl", 600, seed=1)
    _chat_reversals(data / "validation.jsonl", 48, seed=2)

    # the base model from its HF directory: longspan's greedy tokens are transformers'
    prompt = "abcdh="
    want_ids, want = _greedy_hf(hf_dir, prompt, 6)
    ours = _greedy_longspan(hf_dir, prompt, 6, tmp_path)
    assert ours["prompt_ids"] == want_ids and ours["output_ids"] == want[: len(ours["output_ids"])]

    _run(["finetune", "--recipe", "qwen35", f"checkpoint.pretrained_checkpoint={hf_dir}",
          f"dataset.dataset_root={data}", "dataset.packed_sequence_specs.packed_sequence_size=32",
          f"checkpoint.save={out}", f"checkpoint.load={out}", f"logger.tensorboard_dir={out}/tb",
          "checkpoint.save_interval=60", "model.seq_length=32", "mixed_precision=fp32", "train.train_iters=60",
          "train.eval_interval=20", "train.eval_iters=2", "train.global_batch_size=8", "train.micro_batch_size=8",
          "optimizer.lr=1e-2", "scheduler.lr_warmup_iters=5", "peft.dim=8", "peft.alpha=16"],
         cwd=tmp_path)

    import torch.distributed.checkpoint as dcp

    # the recipe adapts the DeltaNet layers (0-2) too: the adapter-only checkpoint holds their adapters
    stored = dcp.FileSystemReader(str(out / "iter_0000060")).read_metadata().state_dict_metadata
    assert "model.decoder.layers.0.self_attention.linear_z.adapter.linear_out.weight" in stored, sorted(stored)[:20]
    assert "model.decoder.layers.2.self_attention.linear_proj.adapter.linear_in.weight" in stored
    records = [json.loads(x) for x in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["losses"]["lm loss"] for r in records if r.get("phase") == "validation"]
    base = next(r["losses"]["lm loss"] for r in records if r.get("iteration") == 1)  # B = 0: the base model's
    assert len(valid) == 3, records[-3:]
    # the random base is above ln(16) per token; letters alone give ln(8)
    assert base > math.log(VOCAB) and valid[-1] < valid[0] and valid[-1] < 0.7 * base, (base, valid)

    # the merged export (adapters folded in) loads in transformers and generates what longspan generates from it
    export = tmp_path / "export"
    _run_here(["convert", "export", "--checkpoint", str(out), "--output", str(export)], cwd=tmp_path)
    assert json.loads((export / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]
    want_ids, want = _greedy_hf(export, prompt, 6)
    ours = _greedy_longspan(export, prompt, 6, tmp_path)
    assert ours["prompt_ids"] == want_ids and ours["output_ids"] == want[: len(ours["output_ids"])]
    # the finetune changed the model's answer (it may stop early: longspan stops at the end-of-text token)
    assert ours["output_ids"] and ours["output_ids"] != _greedy_hf(hf_dir, prompt, 6)[1][: len(ours["output_ids"])]
