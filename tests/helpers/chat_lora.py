"""A LoRA finetune of a tiny HF model on chat data through the `longspan` command, end to end: the base model's
greedy tokens in longspan equal transformers', the finetune lowers the validation loss, and the merged export
loads in transformers and greedy-generates what `longspan generate --hf-model` does from it.

The task: the user says a short word ("abc"), the assistant answers it reversed ("cba"); a character tokenizer
(14 symbols, vocabulary 16) with a chat template, so the loss covers the assistant's tokens only."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import transformers

from tests.test_finetune_e2e import LETTERS, _char_tokenizer, _run, _run_here

VOCAB = 16  # the character tokenizer's 14 symbols, padded
PAD_ID, EOS_ID = 2, 1
# user turn "abc=", assistant turn "cba<eos>": the loss covers the assistant's tokens
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}={% else %}"
                 "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
PROMPT = "abcdh="


def save_chat_tokenizer(directory: Path) -> None:
    """The character tokenizer with the chat template, next to a model saved in ``directory``."""
    _char_tokenizer(directory)
    tokenizer_config = directory / "tokenizer_config.json"
    config = json.loads(tokenizer_config.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    tokenizer_config.write_text(json.dumps(config))


def chat_reversals(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
        lines.append(json.dumps({"messages": [{"role": "user", "content": word},
                                              {"role": "assistant", "content": word[::-1]}]}))
    path.write_text("\n".join(lines) + "\n")


def greedy_hf(directory: Path, prompt: str, n: int) -> tuple[list[int], list[int]]:
    """(prompt ids, ``n`` greedy tokens) of transformers' model loaded from ``directory`` (with its cache)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(str(directory))(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=PAD_ID)[0].tolist()
    return ids[0].tolist(), out[ids.shape[1]:]


def greedy_longspan(directory: Path, prompt: str, n: int, cwd: Path) -> dict:
    """What ``longspan generate --hf-model directory --json`` prints (prompt_ids, output_ids, ...)."""
    printed = _run_here(["generate", "--hf-model", str(directory), "--prompt", prompt, "--max-new-tokens", str(n),
                         "--device", "cpu", "--json"], cwd=cwd)
    return json.loads(printed.strip().splitlines()[-1])


def assert_generates_as_transformers(directory: Path, cwd: Path, n: int = 6) -> tuple[list[int], list[int]]:
    """longspan's greedy tokens from the HF ``directory`` are transformers' (up to longspan stopping at the
    end-of-text token); returns (longspan's, transformers' ``n``)."""
    want_ids, want = greedy_hf(directory, PROMPT, n)
    ours = greedy_longspan(directory, PROMPT, n, cwd)
    assert ours["prompt_ids"] == want_ids and ours["output_ids"] == want[: len(ours["output_ids"])], (ours, want)
    return ours["output_ids"], want


def chat_lora_finetune(tmp_path: Path, hf_dir: Path, recipe: str, overrides: list[str], iters: int = 60,
                       eval_every: int = 20) -> Path:
    """From ``hf_dir`` (a saved model with :func:`save_chat_tokenizer`'s tokenizer): check generation against
    transformers, LoRA-finetune it with ``recipe`` on chat reversals (packed in 32-token sequences, fp32), check
    that the validation loss falls well below the base model's, export the merged model and check that transformers
    loads it and generates what longspan does, and that the finetune changed the answer. Returns the run's
    checkpoint directory (adapter-only checkpoints) for the caller's own checks."""
    data, out, export = tmp_path / "data", tmp_path / "run", tmp_path / "export"
    data.mkdir()
    chat_reversals(data / "training.jsonl", 600, seed=1)
    chat_reversals(data / "validation.jsonl", 48, seed=2)
    _, base_answer = assert_generates_as_transformers(hf_dir, tmp_path)

    _run(["finetune", "--recipe", recipe, f"checkpoint.pretrained_checkpoint={hf_dir}",
          f"dataset.dataset_root={data}", "dataset.packed_sequence_specs.packed_sequence_size=32",
          f"checkpoint.save={out}", f"checkpoint.load={out}", f"logger.tensorboard_dir={out}/tb",
          f"checkpoint.save_interval={iters}", "model.seq_length=32", "mixed_precision=fp32",
          f"train.train_iters={iters}", f"train.eval_interval={eval_every}", "train.eval_iters=2",
          "train.global_batch_size=8", "train.micro_batch_size=8", "optimizer.lr=1e-2", "scheduler.lr_warmup_iters=5",
          "peft.dim=8", "peft.alpha=16", *overrides], cwd=tmp_path)

    stored = dcp.FileSystemReader(str(out / f"iter_{iters:07d}")).read_metadata().state_dict_metadata
    model_tensors = [k for k in stored if k.startswith("model.")]
    assert model_tensors and all(".adapter." in k or k.endswith(".router.expert_bias") for k in model_tensors)
    records = [json.loads(x) for x in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["losses"]["lm loss"] for r in records if r.get("phase") == "validation"]
    base = next(r["losses"]["lm loss"] for r in records if r.get("iteration") == 1)  # B = 0: the base model's
    assert len(valid) == iters // eval_every, records[-3:]
    # a random base is near ln(16) per token; letters alone give ln(8)
    assert base > 0.9 * math.log(VOCAB) and valid[-1] < valid[0] and valid[-1] < 0.7 * base, (base, valid)

    architecture = json.loads((hf_dir / "config.json").read_text())["architectures"]
    _run_here(["convert", "export", "--checkpoint", str(out), "--output", str(export)], cwd=tmp_path)
    assert json.loads((export / "config.json").read_text())["architectures"] == architecture
    answer, _ = assert_generates_as_transformers(export, tmp_path)
    # the finetune changed the model's answer (it may stop early: longspan stops at the end-of-text token)
    assert answer and answer != base_answer[: len(answer)], (answer, base_answer)
    return out


def adapted_modules(run: Path, iters: int = 60) -> set[str]:
    """The module names (``model.`` and ``.adapter...`` dropped) that the run's last checkpoint holds adapters of."""
    stored = dcp.FileSystemReader(str(run / f"iter_{iters:07d}")).read_metadata().state_dict_metadata
    return {k[len("model."): k.index(".adapter.")] for k in stored if k.startswith("model.") and ".adapter." in k}
