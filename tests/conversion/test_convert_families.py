"""``longspan convert import`` then ``convert export`` for one model of every supported HF architecture.

No recipe is consulted: the checkpoint's run_config.yaml holds the model derived from config.json alone (a
Mamba-2 or T5 directory imports as such), and the export gives back every tensor bit for bit and the same
config.json. In-process through ``longspan.cli.main``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from longspan.cli import main
from longspan.conversion import families
from longspan.config.schema.container import ConfigContainer
from tests.conversion.hf_models import EVERY_ARCHITECTURE, VOCAB, make_hf_model, read_config

_DTYPE_KEYS = ("dtype", "torch_dtype")


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


@pytest.mark.parametrize("family", EVERY_ARCHITECTURE)
def test_import_then_export_is_bit_exact_without_a_recipe(tmp_path, family):
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    make_hf_model(family, src, tokenizer=family != "mamba2")  # one family without tokenizer files
    assert main(["convert", "import", "--hf-model", str(src), "--output", str(ckpt), "--no-progress"]) == 0

    saved = ConfigContainer.from_yaml(str(ckpt / "iter_0000000" / "run_config.yaml"))
    family_of_src = families.family_for_config(read_config(src))
    assert type(saved.model) is family_of_src.provider_class
    assert saved.model.vocab_size == VOCAB and saved.tokenizer.vocab_extra_ids == 0
    expected_tokenizer = "NullTokenizer" if family == "mamba2" else "HuggingFaceTokenizer"
    assert saved.tokenizer.tokenizer_type == expected_tokenizer

    assert main(["convert", "export", "--checkpoint", str(ckpt), "--output", str(out), "--no-progress"]) == 0
    original, exported = _tensors(src), _tensors(out)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    want, got = read_config(src), read_config(out)
    assert got.get("dtype") == want.get("dtype", want.get("torch_dtype"))
    assert {k: v for k, v in got.items() if k not in _DTYPE_KEYS} == \
        {k: v for k, v in want.items() if k not in _DTYPE_KEYS}
    if family != "mamba2":
        assert json.loads((out / "tokenizer.json").read_text()) == json.loads((src / "tokenizer.json").read_text())


def test_import_overrides_and_config_files_set_the_saved_run(tmp_path):
    """Dotlist overrides and ``--config`` files apply on top of the configuration derived from config.json."""
    src, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    make_hf_model("mamba2", src, tokenizer=False)
    layout = tmp_path / "layout.yaml"
    layout.write_text("model:\n  seq_length: 48\n")
    assert main(["convert", "import", "--hf-model", str(src), "--output", str(ckpt), "--no-progress",
                 "--config", str(layout), "model.hidden_dropout=0.0"]) == 0
    saved = ConfigContainer.from_yaml(str(ckpt / "iter_0000000" / "run_config.yaml"))
    assert (saved.model.seq_length, saved.model.hidden_dropout) == (48, 0.0)
    assert saved.checkpoint.save == str(ckpt) and not saved.checkpoint.save_optim
