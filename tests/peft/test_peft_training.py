"""PEFT through the real trainer: adapter-only checkpoints, stop-and-resume bit for bit with dropout on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from longspan.core.errors import CheckpointError
from longspan.peft import CanonicalLoRA, DoRA, LoRA
from longspan.peft.adapters import is_adapter_key
from longspan.training.finetune import finetune
from longspan.training.step.forward_step import forward_step
from longspan.training.pretrain import pretrain
from tests.training.pretrain_helpers import losses_by_iteration, small_config

ITERS = 8


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _model_tensor_bytes(directory: Path) -> int:
    metadata = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return sum(4 * torch.Size(m.size).numel() for k, m in metadata.items() if k.startswith("model.") and hasattr(m, "size"))


def _stored_keys(directory: Path) -> set[str]:
    return set(dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata)


def _peft_config(tmp: Path, name: str, base: Path, peft, **train):
    cfg = small_config(tmp, name, train_iters=ITERS, **train)
    cfg.train.eval_interval = 4
    cfg.model.hidden_dropout = 0.1
    cfg.model.attention_dropout = 0.1
    cfg.checkpoint.pretrained_checkpoint = str(base)
    cfg.peft = peft
    cfg.optimizer.lr = 1e-2
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("peft", [LoRA(dim=4, dropout=0.1), DoRA(dim=4, dropout=0.1),
                                  CanonicalLoRA(dim=4, dropout=0.1, dropout_position="post")],
                         ids=lambda p: type(p).__name__)
def test_stop_and_resume_is_bit_exact_with_dropout(tmp_path: Path, base_checkpoint: Path, peft) -> None:
    straight = _peft_config(tmp_path, "straight", base_checkpoint, peft)
    finetune(straight, forward_step)
    reference = losses_by_iteration(straight)
    assert sorted(reference) == list(range(1, ITERS + 1))

    first = _peft_config(tmp_path, "resumed", base_checkpoint, peft, exit_interval=ITERS // 2)
    state = finetune(first, forward_step)
    assert state.train_state.step == ITERS // 2
    second = _peft_config(tmp_path, "resumed", base_checkpoint, peft)
    state = finetune(second, forward_step)
    assert state.train_state.step == ITERS
    resumed = losses_by_iteration(second)
    assert [resumed[i] for i in range(1, ITERS + 1)] == [reference[i] for i in range(1, ITERS + 1)]


def test_adapter_checkpoint_holds_only_adapters_and_is_small(tmp_path: Path, base_checkpoint: Path) -> None:
    cfg = _peft_config(tmp_path, "lora", base_checkpoint, LoRA(dim=4))
    cfg.checkpoint.save_interval = ITERS
    state = finetune(cfg, forward_step)
    adapter_dir = Path(cfg.checkpoint.save) / f"iter_{ITERS:07d}"
    base_dir = base_checkpoint / "iter_0000004"
    model_keys = {k for k in _stored_keys(adapter_dir) if k.startswith("model.")}
    assert model_keys and all(is_adapter_key(k) for k in model_keys)
    assert any(k.startswith("optimizer.") for k in _stored_keys(adapter_dir))
    adapter_tensors, base_tensors = _model_tensor_bytes(adapter_dir), _model_tensor_bytes(base_dir)
    adapter_bytes, base_bytes = _dir_bytes(adapter_dir), _dir_bytes(base_dir)
    print(f"\nadapter weights {adapter_tensors} B vs base weights {base_tensors} B ({adapter_tensors / base_tensors:.3f}); "
          f"directories: adapter {adapter_bytes} B (with optimizer/RNG state) vs base {base_bytes} B")
    assert adapter_tensors < 0.1 * base_tensors
    assert state.train_state.step == ITERS


def test_peft_without_pretrained_checkpoint_is_a_one_line_error(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, "nobase", train_iters=6)
    cfg.peft = LoRA(dim=4)
    with pytest.raises(CheckpointError, match="pretrained_checkpoint"):
        pretrain(cfg, forward_step)
