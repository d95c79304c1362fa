"""Tiny trained checkpoints and tokenizers for the inference tests (seconds, one process, CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.training.pretrain_helpers import small_config

CORPUS = [f"line {i}: the quick brown fox jumps over the lazy dog; def f{i}(x): return x * {i}\n" for i in range(200)]


def train_bpe_tokenizer(directory: Path, vocab_size: int = 200) -> Path:
    """A byte-level BPE ``tokenizer.json`` (+ tokenizer_config.json naming EOS) trained on a small corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<pad>"})
    )
    return directory


def train_tiny_checkpoint(tmp_path: Path, iters: int = 3, **model_overrides: Any) -> tuple[Path, torch.nn.Module, Any]:
    """Pretrain the shrunk tiny recipe (HF BPE tokenizer, mock data) for ``iters`` iterations, saving at the end.

    Returns (save root, the trained model as it was when saved, the run's config).
    """
    from longspan.training.step.forward_step import forward_step
    from longspan.training.pretrain import pretrain

    cfg = small_config(tmp_path, train_iters=iters, eval_interval=None, eval_iters=0)
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = str(train_bpe_tokenizer(tmp_path / "tokenizer_src"))
    cfg.tokenizer.vocab_size = None
    cfg.model.hidden_dropout = 0.1  # on in training; the loaded model is in eval mode
    for key, value in model_overrides.items():
        setattr(cfg.model, key, value)
    cfg.checkpoint.save_interval = iters
    cfg.scheduler.lr_warmup_iters = 1
    seen: list[torch.nn.Module] = []

    def capturing_forward_step(state: Any, data_iterator: Any, model: torch.nn.Module) -> Any:
        if not seen:
            seen.append(model)
        return forward_step(state, data_iterator, model)

    pretrain(cfg, capturing_forward_step)
    return Path(cfg.checkpoint.save), seen[0], cfg
