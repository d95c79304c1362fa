"""A LoRA finetune of an MoE model with aux-loss-free routing (``router.expert_bias``) through the real trainer.

The bias is a buffer the trainer updates every step from token counts although the base is frozen, so an
adapter checkpoint holds it next to the adapters: a stop (iteration 3 of 6) and resume gives the straight
run's losses bit for bit with dropout on and saves its bias; the merged model (``load_model_from_checkpoint``
with ``merge_adapters``, ``peft merge``) carries the finetuned bias, not the pretrained one; the HF PEFT adapter
export, which cannot hold it, says so in one line.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from longspan.peft import LoRA
from longspan.peft.adapters import is_adapter_key
from longspan.training.finetune import finetune
from longspan.training.pretrain import pretrain
from longspan.training.step.forward_step import forward_step
from tests.parallel.test_moe_bias import bias_config
from tests.training.pretrain_helpers import losses_by_iteration

ITERS = 6
BIAS_KEYS = [f"decoder.layers.{i}.mlp.router.expert_bias" for i in range(2)]


def _config(tmp: Path, name: str, train_iters: int, exit_interval: int | None = None):
    cfg = bias_config()
    cfg.train.train_iters = train_iters
    cfg.train.exit_interval = exit_interval
    cfg.train.eval_interval = None
    cfg.train.eval_iters = 0
    cfg.scheduler.lr_warmup_fraction = None
    cfg.scheduler.lr_warmup_iters = 1
    run_dir = tmp / name
    cfg.checkpoint.save = str(run_dir / "ckpt")
    cfg.checkpoint.load = str(run_dir / "ckpt")
    cfg.checkpoint.save_interval = None
    cfg.logger.tensorboard_dir = str(run_dir / "tb")
    cfg.logger.log_interval = 1
    return cfg


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pretrained tiny MoE (3 iterations: its bias has moved off zero), saved without optimizer state."""
    tmp = tmp_path_factory.mktemp("peft_bias_base")
    cfg = _config(tmp, "base", train_iters=3)
    cfg.checkpoint.save_optim = False
    cfg.checkpoint.save_interval = 3
    pretrain(cfg, forward_step)
    return Path(cfg.checkpoint.save)


def _lora_config(tmp: Path, name: str, base: Path, exit_interval: int | None = None):
    cfg = _config(tmp, name, train_iters=ITERS, exit_interval=exit_interval)
    cfg.model.hidden_dropout = 0.1
    cfg.model.attention_dropout = 0.1
    cfg.checkpoint.pretrained_checkpoint = str(base)
    cfg.peft = LoRA(dim=4, dropout=0.1)
    cfg.optimizer.lr = 1e-2
    return cfg


def _saved_biases(directory: Path) -> list[torch.Tensor]:
    want = {"model": {k: torch.empty(4) for k in BIAS_KEYS}}
    dcp.load(want, checkpoint_id=str(directory))
    return [want["model"][k] for k in BIAS_KEYS]


def _iteration_dir(save_root: Path | str, iteration: int) -> Path:
    return Path(save_root) / f"iter_{iteration:07d}"


def _model_biases(model) -> list[torch.Tensor]:
    from longspan.models.moe import moe_layers

    return [layer.router.expert_bias.detach().clone() for layer in moe_layers(model)]


def test_lora_stop_and_resume_keeps_the_finetuned_routing_bias(tmp_path: Path, base_checkpoint: Path) -> None:
    from longspan.training.checkpointing.model_loading import load_model_from_checkpoint
    from longspan.training.checkpointing.peft_checkpoint import merge_adapter_checkpoint

    pretrained = _saved_biases(_iteration_dir(base_checkpoint, 3))
    assert all(b.abs().max() > 0 for b in pretrained)

    straight = _lora_config(tmp_path, "straight", base_checkpoint)
    finetune(straight, forward_step)
    reference = losses_by_iteration(straight)
    assert sorted(reference) == list(range(1, ITERS + 1))
    finetuned = _saved_biases(_iteration_dir(straight.checkpoint.save, ITERS))
    assert any(not torch.equal(f, p) for f, p in zip(finetuned, pretrained))  # the finetune moved the bias
    stored = dcp.FileSystemReader(str(_iteration_dir(straight.checkpoint.save, ITERS))).read_metadata()
    model_keys = {k[len("model."):] for k in stored.state_dict_metadata if k.startswith("model.")}
    assert {k for k in model_keys if not is_adapter_key(k)} == set(BIAS_KEYS)  # adapters + bias, no base

    state = finetune(_lora_config(tmp_path, "resumed", base_checkpoint, exit_interval=3), forward_step)
    assert state.train_state.step == 3
    resumed_cfg = _lora_config(tmp_path, "resumed", base_checkpoint)
    state = finetune(resumed_cfg, forward_step)
    assert state.train_state.step == ITERS
    resumed = losses_by_iteration(resumed_cfg)
    assert [resumed[i] for i in range(1, ITERS + 1)] == [reference[i] for i in range(1, ITERS + 1)]
    for got, want in zip(_saved_biases(_iteration_dir(resumed_cfg.checkpoint.save, ITERS)), finetuned):
        assert torch.equal(got, want)

    # The merged model (generate / export / peft merge) routes with the finetuned bias.
    adapter_ckpt = straight.checkpoint.save
    merged = load_model_from_checkpoint(adapter_ckpt, device="cpu", merge_adapters=True)
    for got, want in zip(_model_biases(merged.model[0]), finetuned):
        assert torch.equal(got, want)
    out = merge_adapter_checkpoint(adapter_ckpt, tmp_path / "merged")
    for got, want in zip(_saved_biases(_iteration_dir(out, ITERS)), finetuned):
        assert torch.equal(got, want)


def test_hf_adapter_export_says_the_routing_bias_is_left_out(tmp_path: Path) -> None:
    from longspan.peft.hf_export import ADAPTER_WEIGHTS, save_hf_peft_adapter

    class Bridge:  # one HF module per adapted layer, named as in longspan
        @staticmethod
        def hf_module_name(name: str) -> str:
            return name

        @staticmethod
        def hf_row_block(name: str) -> None:
            return None

    class Lines(logging.Handler):  # the "longspan" logger may not propagate to pytest's handler
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    def export(with_bias: bool, name: str) -> list[str]:
        cfg = bias_config()
        cfg.model.moe_router_enable_expert_bias = with_bias
        cfg.peft = LoRA(dim=4, target_modules=["linear_qkv"])
        model = cfg.model.provide()
        cfg.peft.apply(model)
        handler = Lines()
        hf_logger.addHandler(handler)
        try:
            save_hf_peft_adapter(model, cfg.peft, Bridge(), tmp_path / name)
        finally:
            hf_logger.removeHandler(handler)
        assert (tmp_path / name / ADAPTER_WEIGHTS).is_file()
        return handler.lines

    hf_logger = logging.getLogger("longspan.peft.hf_export")
    assert export(with_bias=False, name="plain") == []
    lines = export(with_bias=True, name="bias")
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "router.expert_bias" in lines[0] and "merge" in lines[0]
