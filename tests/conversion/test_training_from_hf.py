"""Training from an HF directory (checkpoint.pretrained_checkpoint) and also_save_hf_checkpoint."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from longspan.training.finetune import finetune
from longspan.training.step.forward_step import get_batch, loss_func
from longspan.training.pretrain import pretrain
from tests.conversion.hf_models import make_hf_model
from tests.training.pretrain_helpers import losses_by_iteration, small_config


def _recording_forward_step(batches: list):
    def forward_step(state, data_iterator, model):
        batch = get_batch(data_iterator, torch.device("cpu"))
        if model.training:
            batches.append(batch)
        output = model(batch["tokens"], position_ids=batch.get("position_ids"), labels=batch["labels"])
        return output, partial(loss_func, batch["loss_mask"])
    return forward_step


def _hf_loss(hf, batches) -> float:
    hf.config._attn_implementation = "eager"
    total, count = 0.0, 0.0
    with torch.no_grad():
        for b in batches:
            logits = hf(input_ids=b["tokens"], position_ids=b.get("position_ids")).logits
            ce = F.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten(), reduction="none")
            mask = b["loss_mask"].flatten().float()
            total += float((ce * mask).sum())
            count += float(mask.sum())
    return total / count


def _config(tmp_path, hf_dir):
    cfg = small_config(tmp_path, train_iters=1, eval_interval=100, eval_iters=0)
    cfg.checkpoint.pretrained_checkpoint = str(hf_dir)
    cfg.checkpoint.load = None
    cfg.optimizer.lr = 0.0
    cfg.optimizer.min_lr = 0.0
    cfg.scheduler.lr_warmup_iters = 0
    cfg.dataset.sequence_length = cfg.model.seq_length = 32
    return cfg


@pytest.mark.parametrize("family,entry", [("llama", finetune), ("mixtral", pretrain)])
def test_first_loss_equals_transformers_loss(tmp_path, family, entry):
    hf_dir = tmp_path / "hf"
    hf = make_hf_model(family, hf_dir)
    cfg = _config(tmp_path, hf_dir)
    cfg.model.num_layers = 7  # replaced by config.json's architecture
    batches: list = []
    entry(cfg, _recording_forward_step(batches))
    assert cfg.model.num_layers == 2 and cfg.model.vocab_size == hf.config.vocab_size
    assert cfg.tokenizer.tokenizer_type == "HuggingFaceTokenizer" and cfg.tokenizer.tokenizer_model == str(hf_dir)
    assert len(batches) == 4  # 8 samples in microbatches of 2
    loss = losses_by_iteration(cfg)[1]
    assert abs(loss - _hf_loss(hf, batches)) <= 1e-5, (loss, _hf_loss(hf, batches))


def test_also_save_hf_checkpoint_writes_hf_dir_beside_each_save(tmp_path):
    hf_dir = tmp_path / "hf"
    make_hf_model("qwen2", hf_dir)
    cfg = _config(tmp_path, hf_dir)
    cfg.checkpoint.also_save_hf_checkpoint = True
    cfg.checkpoint.save_interval = 1
    pretrain(cfg, _recording_forward_step([]))
    out = tmp_path / "run" / "ckpt" / "iter_0000001" / "hf"
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert not list((tmp_path / "run" / "ckpt").glob("*.partial"))
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as a, safe_open(str(out / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():  # lr=0: the weights did not move
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


def test_also_save_hf_checkpoint_off_by_default(tmp_path):
    hf_dir = tmp_path / "hf"
    make_hf_model("llama", hf_dir)
    cfg = _config(tmp_path, hf_dir)
    cfg.checkpoint.save_interval = 1
    pretrain(cfg, _recording_forward_step([]))
    assert (tmp_path / "run" / "ckpt" / "iter_0000001").is_dir()
    assert not (tmp_path / "run" / "ckpt" / "iter_0000001" / "hf").exists()


def test_lora_on_an_hf_base(tmp_path):
    """PEFT takes its frozen base from an HF directory (adapters start as identity: LoRA's B is zero)."""
    from longspan.peft import LoRA

    hf_dir = tmp_path / "hf"
    hf = make_hf_model("llama", hf_dir)
    cfg = _config(tmp_path, hf_dir)
    cfg.peft = LoRA()
    batches: list = []
    finetune(cfg, _recording_forward_step(batches))
    assert abs(losses_by_iteration(cfg)[1] - _hf_loss(hf, batches)) <= 1e-5
