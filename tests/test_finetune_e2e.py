"""End to end through the `longspan` command: Hugging Face model in -> LoRA finetune -> Hugging Face model out.
The finetune runs as its own process; the export and the generation call the command's entry point in this one.

A tiny random HF Llama and a character-level tokenizer are made locally; the task is reversing short words
(prompt "reverse: abc=", completion "cba"). The run must lower the validation loss clearly, save adapter-only
checkpoints, and export a merged HF model that transformers loads and that answers like longspan's model.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
LONGSPAN = [sys.executable, "-m", "longspan"]
LETTERS = "abcdefgh"


def _char_tokenizer(directory: Path) -> None:
    symbols = ["<unk>", "<eos>", "<pad>"] + list(LETTERS) + list(" :=")
    tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                                pad_token="<pad>")
    fast.save_pretrained(str(directory))


def _hf_base(directory: Path) -> None:
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 10000.0})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(directory))
    _char_tokenizer(directory)


def _reverse_words(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
        lines.append(json.dumps({"input": f"{word}=", "output": word[::-1]}))
    path.write_text("\n".join(lines) + "\n")


def _hf_completion_loss(hf_dir: Path, jsonl: Path) -> float:
    """The base model's mean loss over the completion tokens (and EOS) of ``jsonl``, computed by transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    total, count = 0.0, 0
    for line in jsonl.read_text().splitlines():
        record = json.loads(line)
        prompt = tokenizer(record["input"] + " ").input_ids
        completion = tokenizer(record["output"]).input_ids + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt + completion])
        labels = torch.tensor([[-100] * len(prompt) + completion])
        with torch.no_grad():
            total += model(input_ids=ids, labels=labels).loss.item() * len(completion)
        count += len(completion)
    return total / count


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(LONGSPAN + args, env=ENV, capture_output=True, text=True, timeout=900, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _run_here(args: list[str], cwd: Path) -> str:
    """``longspan <args>`` in this process from ``cwd`` (the command's entry point without a new interpreter's
    start-up); returns what it printed on stdout."""
    import contextlib
    import io

    from longspan.cli import main

    printed = io.StringIO()
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(printed):
            code = main(args)
    finally:
        os.chdir(previous)
    assert code == 0, printed.getvalue()[-3000:]
    return printed.getvalue()


def test_lora_finetune_of_an_hf_model_from_the_cli(tmp_path: Path) -> None:
    hf_dir, data, out = tmp_path / "hf", tmp_path / "data", tmp_path / "run"
    hf_dir.mkdir()
    data.mkdir()
    _hf_base(hf_dir)
    _reverse_words(data / "training.jsonl", 2000, seed=1)
    _reverse_words(data / "validation.jsonl", 64, seed=2)

    before = _hf_completion_loss(hf_dir, data / "validation.jsonl")
    _run(["finetune", "--recipe", "lora", f"checkpoint.pretrained_checkpoint={hf_dir}",
          f"dataset.dataset_root={data}", f"checkpoint.save={out}", f"checkpoint.load={out}",
          f"logger.tensorboard_dir={out}/tb", "checkpoint.save_interval=150", "model.seq_length=16",
          "train.train_iters=300", "train.eval_interval=100", "train.eval_iters=4", "train.global_batch_size=16",
          "train.micro_batch_size=16", "optimizer.lr=5e-3", "scheduler.lr_warmup_iters=10", "peft.dim=16",
          "peft.alpha=32"], cwd=tmp_path)

    records = [json.loads(x) for x in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["losses"]["lm loss"] for r in records if r.get("phase") == "validation"]
    assert len(valid) == 3, records[-3:]
    # Letter frequencies alone give ln(8) ~ 2.08 per completion letter; the base model starts near ln(16).
    assert valid[-1] < 0.7 * before and valid[-1] < valid[0], (before, valid)

    # Adapter-only checkpoints: no base tensor is saved again.
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    stored = dcp.FileSystemReader(str(out / "iter_0000300")).read_metadata().state_dict_metadata
    model_tensors = {k: v for k, v in stored.items() if k.startswith("model.")}
    assert model_tensors and all(".adapter." in k for k in model_tensors), sorted(model_tensors)
    adapter_numel = sum(v.size.numel() for v in model_tensors.values())
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        base_numel = sum(f.get_slice(k).get_shape().numel() if hasattr(f.get_slice(k).get_shape(), "numel")
                         else torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    assert adapter_numel < 0.35 * base_numel, (adapter_numel, base_numel)

    # HF model out (adapters merged), loadable by transformers, greedy answers equal longspan's generate.
    export = tmp_path / "export"
    _run_here(["convert", "export", "--checkpoint", str(out), "--output", str(export)], cwd=tmp_path)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
    prompt = "abcdh= "
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    hf_ids = merged.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=2)[0].tolist()
    gen = _run_here(["generate", "--checkpoint", str(out), "--prompt", prompt, "--max-new-tokens", "4", "--json"],
                    cwd=tmp_path)
    ours = json.loads(gen.strip().splitlines()[-1])
    assert ours["prompt_ids"] == ids[0].tolist()
    assert ours["output_ids"] == hf_ids[len(ours["prompt_ids"]):][: len(ours["output_ids"])]
