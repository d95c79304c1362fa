"""QLoRA through the real trainer: a finetune from a longspan checkpoint whose loss falls and that resumes bit for
bit (the NF4 base is re-quantized from the pretrained checkpoint, not saved), and a finetune of a local HF model
whose merged export (dequantized base + LoRA delta) loads in transformers with the adapted model's logits."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from safetensors import safe_open

from longspan.cli import main as cli_main
from longspan.peft import LoRA
from longspan.peft.adapters import is_adapter_key
from longspan.peft.qlora import NF4LoRALinear
from longspan.training.checkpointing.model_loading import load_model_from_checkpoint
from longspan.training.finetune import finetune
from longspan.training.step.forward_step import forward_step
from tests.conversion.hf_models import hf_logits, make_hf_model
from tests.peft.test_peft_training import _stored_keys
from tests.training.pretrain_helpers import losses_by_iteration, small_config

ITERS = 6


def _config(tmp: Path, name: str, base: Path, quantization: str | None = "nf4", **train):
    cfg = small_config(tmp, name, train_iters=ITERS, **train)
    cfg.train.eval_interval, cfg.train.eval_iters = None, 0
    cfg.model.hidden_dropout = 0.1
    cfg.checkpoint.pretrained_checkpoint = str(base)
    cfg.checkpoint.save_interval = ITERS
    cfg.peft = LoRA(dim=4, alpha=8, dropout=0.1, base_quantization=quantization)
    cfg.optimizer.lr = 1e-2
    return cfg


def test_qlora_loss_falls_and_stop_resume_is_bit_exact(tmp_path: Path, base_checkpoint: Path) -> None:
    straight = _config(tmp_path, "straight", base_checkpoint)
    finetune(straight, forward_step)
    reference = losses_by_iteration(straight)
    assert sorted(reference) == list(range(1, ITERS + 1))
    assert reference[ITERS] < reference[1]
    saved = Path(straight.checkpoint.save) / f"iter_{ITERS:07d}"
    model_keys = {k for k in _stored_keys(saved) if k.startswith("model.")}
    assert model_keys and all(is_adapter_key(k) for k in model_keys)  # no base, no NF4 buffers saved

    full = _config(tmp_path, "full_precision_base", base_checkpoint, quantization=None)
    finetune(full, forward_step)
    assert losses_by_iteration(full)[1] != reference[1]  # the NF4 base computes differently

    first = _config(tmp_path, "resumed", base_checkpoint, exit_interval=ITERS // 2)
    assert finetune(first, forward_step).train_state.step == ITERS // 2
    second = _config(tmp_path, "resumed", base_checkpoint)
    assert finetune(second, forward_step).train_state.step == ITERS
    resumed = losses_by_iteration(second)
    assert [resumed[i] for i in range(1, ITERS + 1)] == [reference[i] for i in range(1, ITERS + 1)]


def test_qlora_from_hf_directory_merges_to_a_model_transformers_loads(tmp_path: Path) -> None:
    hf_dir = tmp_path / "hf"
    make_hf_model("llama", hf_dir)
    cfg = small_config(tmp_path, "ft", train_iters=4)
    cfg.train.eval_interval, cfg.train.eval_iters = None, 0
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = str(hf_dir)
    cfg.model.seq_length = cfg.dataset.sequence_length = 32
    cfg.checkpoint.pretrained_checkpoint = str(hf_dir)
    cfg.checkpoint.save_interval = 4
    cfg.optimizer.lr = 5e-2
    cfg.peft = LoRA(dim=4, alpha=8, base_quantization="nf4")
    finetune(cfg, forward_step)
    ckpt = cfg.checkpoint.save

    adapted = load_model_from_checkpoint(ckpt, device="cpu")
    layers = [m for m in adapted.model[0].modules() if isinstance(m, NF4LoRALinear)]
    assert layers, "the reloaded adapter checkpoint computes on the NF4 base"
    tokens = torch.randint(0, 80, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = adapted.model[0].eval()(tokens)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir))
    assert (ours - hf_logits(base, tokens)).abs().max().item() > 1e-4

    assert cli_main(["convert", "export", "--checkpoint", ckpt, "--output", str(tmp_path / "merged_hf"),
                     "--no-progress"]) == 0
    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged_hf"),
                                                                  torch_dtype=torch.float32)
    assert (hf_logits(merged_hf, tokens) - ours).abs().max().item() <= 1e-5

    # the bf16 model people serve: the same merge with the model loaded in bf16
    assert cli_main(["convert", "export", "--checkpoint", ckpt, "--output", str(tmp_path / "merged_bf16"),
                     "--no-progress", "model.params_dtype=bf16"]) == 0
    with safe_open(str(tmp_path / "merged_bf16" / "model.safetensors"), "pt") as fh:
        assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.bfloat16}
    merged_bf16 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged_bf16"))
    bf16_logits = hf_logits(merged_bf16.float(), tokens)
    assert (bf16_logits - ours).abs().max().item() <= 0.05 * ours.abs().max().item()

    assert cli_main(["peft", "merge", "--checkpoint", ckpt, "--output", str(tmp_path / "merged_ckpt")]) == 0
    merged = load_model_from_checkpoint(str(tmp_path / "merged_ckpt"), device="cpu")
    assert merged.cfg.peft is None
    with torch.no_grad():
        assert (merged.model[0].eval()(tokens) - ours).abs().max().item() <= 1e-5
