"""An adapter checkpoint is first class: LoRA/DoRA-finetune a local HF model, then ``convert export`` (merged,
loaded by transformers), ``convert export --adapter-only`` (loaded by peft onto the HF base) and ``peft merge``
(a full longspan checkpoint) all give the logits of the unmerged adapted model (<= 1e-5)."""

from __future__ import annotations

from pathlib import Path

import peft as hf_peft
import pytest
import torch
import transformers

from longspan.cli import main as cli_main
from longspan.core.errors import CheckpointError
from longspan.peft import DoRA, LoRA
from longspan.training.finetune import finetune
from longspan.training.step.forward_step import forward_step
from longspan.training.checkpointing.model_loading import load_model_from_checkpoint
from tests.conversion.hf_models import hf_logits, make_hf_model
from tests.training.pretrain_helpers import small_config

pytestmark = pytest.mark.slow


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.mark.parametrize("config", [LoRA(dim=4, alpha=8), DoRA(dim=4, alpha=8)], ids=["lora", "dora"])
def test_adapter_checkpoint_exports_merges_and_loads(config, tmp_path: Path) -> None:
    hf_dir = tmp_path / "hf"
    make_hf_model("llama", hf_dir)
    cfg = small_config(tmp_path, "ft", train_iters=6)
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = str(hf_dir)
    cfg.model.seq_length = cfg.dataset.sequence_length = 32
    cfg.checkpoint.pretrained_checkpoint = str(hf_dir)
    cfg.checkpoint.save_interval = 6
    cfg.optimizer.lr = 5e-2
    cfg.peft = config
    finetune(cfg, forward_step)
    ckpt = cfg.checkpoint.save

    tokens = torch.randint(0, 80, (2, 10), generator=torch.Generator().manual_seed(0))
    adapted = load_model_from_checkpoint(ckpt, device="cpu")
    assert adapted.cfg.peft == config and adapted.iteration == 6
    ours = _logits(adapted.model[0], tokens)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir))
    assert (ours - hf_logits(base, tokens)).abs().max().item() > 1e-4  # training moved the adapters

    assert cli_main(["convert", "export", "--checkpoint", ckpt, "--output", str(tmp_path / "merged_hf"),
                     "--no-progress"]) == 0
    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged_hf"))
    assert (hf_logits(merged_hf, tokens) - ours).abs().max().item() <= 1e-5

    assert cli_main(["convert", "export", "--checkpoint", ckpt, "--output", str(tmp_path / "adapter"),
                     "--adapter-only"]) == 0
    with_adapter = hf_peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    assert (hf_logits(with_adapter, tokens) - ours).abs().max().item() <= 1e-5

    assert cli_main(["peft", "merge", "--checkpoint", ckpt, "--output", str(tmp_path / "merged_ckpt")]) == 0
    merged = load_model_from_checkpoint(str(tmp_path / "merged_ckpt"), device="cpu")
    assert merged.cfg.peft is None
    assert (_logits(merged.model[0], tokens) - ours).abs().max().item() <= 1e-5


def test_merge_of_a_full_checkpoint_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    from longspan.training.pretrain import pretrain

    cfg = small_config(tmp_path, "full", train_iters=4)
    cfg.checkpoint.save_interval = 4
    pretrain(cfg, forward_step)
    assert cli_main(["peft", "merge", "--checkpoint", cfg.checkpoint.save, "--output", str(tmp_path / "o")]) == 2
    assert "holds no adapters" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="holds no adapters"):
        from longspan.training.checkpointing.peft_checkpoint import export_adapter_checkpoint

        export_adapter_checkpoint(cfg.checkpoint.save, tmp_path / "a")
