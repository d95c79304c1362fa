"""Checkpoints written before the family packages existed still load and export.

``fixtures/main_2026_12_01/checkpoint`` is a Qwen2 model imported with ``longspan convert import`` by the main of
2026-12-01 (its run_config.yaml, DCP files and ``hf_config.json`` as that code wrote them, no
``model_family.json``); ``source_model.safetensors`` / ``source_config.json`` are the HF files it came from. The
export must give back those tensors bit for bit: from the imported ``hf_config.json``, and without it through the
fallback that infers the architecture from the model's fields.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from longspan.cli import main
from longspan.conversion.checkpoints import HF_CONFIG_IN_CHECKPOINT, MODEL_FAMILY_IN_CHECKPOINT
from longspan.training.checkpointing.model_loading import load_model_from_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "main_2026_12_01"


def _exported(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture()
def old_checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "checkpoint"
    shutil.copytree(FIXTURE / "checkpoint", ckpt)
    assert not (ckpt / "iter_0000000" / MODEL_FAMILY_IN_CHECKPOINT).exists()
    return ckpt


@pytest.mark.parametrize("keep_imported_config", [True, False], ids=["imported-config", "inferred"])
def test_an_old_checkpoint_exports_its_source_bit_for_bit(old_checkpoint: Path, tmp_path: Path,
                                                         keep_imported_config: bool) -> None:
    if not keep_imported_config:
        (old_checkpoint / "iter_0000000" / HF_CONFIG_IN_CHECKPOINT).unlink()
    out = tmp_path / "hf"
    assert main(["convert", "export", "--checkpoint", str(old_checkpoint), "--output", str(out),
                 "--no-progress"]) == 0
    source = load_file(str(FIXTURE / "source_model.safetensors"))
    exported = _exported(out)
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == json.loads((FIXTURE / "source_config.json").read_text())["architectures"]


def test_an_old_checkpoint_loads_for_generation(old_checkpoint: Path) -> None:
    loaded = load_model_from_checkpoint(str(old_checkpoint))
    tokens = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        logits = loaded.model[0](tokens)
    assert logits.shape[:2] == (1, 5) and torch.isfinite(logits).all()
    assert loaded.cfg.model.add_qkv_bias and not loaded.cfg.model.add_bias_linear and loaded.iteration == 0
