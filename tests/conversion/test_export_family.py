"""A checkpoint records the HF family its model was built as (``model_family.json``) and the export reads it;
checkpoints without the record export as the family inferred from the model (``longspan.families.fallback``)."""

from __future__ import annotations

import json

import torch
import transformers

from longspan.cli import main
from longspan.config.explicit import model_family
from longspan.conversion.checkpoints import MODEL_FAMILY_IN_CHECKPOINT
from longspan.conversion.families import family_for_provider
from longspan.recipes import RECIPE_FAMILY, RECIPES, get_recipe
from longspan.training.checkpointing.model_loading import load_checkpoint_config, load_model_from_checkpoint
from tests.conversion.hf_models import hf_logits, make_hf_model


def _architecture(directory) -> list[str]:
    return json.loads((directory / "config.json").read_text())["architectures"]


def test_a_family_recipe_checkpoint_exports_as_its_family_and_without_the_record_as_inferred(
        tmp_path, monkeypatch, capsys):
    from tests.training.pretrain_helpers import small_config
    from longspan.training.pretrain import pretrain

    # A family recipe (as a family package registers one): a Llama-shaped model built as Mistral, which the
    # inference alone would export as Llama (no sliding window).
    monkeypatch.setitem(RECIPES, "mistral-shaped", lambda: small_config(tmp_path, train_iters=1, eval_iters=0))
    monkeypatch.setitem(RECIPE_FAMILY, "mistral-shaped", "mistral")
    cfg = get_recipe("mistral-shaped")
    assert model_family(cfg) == "mistral"
    assert family_for_provider(cfg.model).architecture == "LlamaForCausalLM"
    cfg.checkpoint.save_interval = 1
    cfg.scheduler.lr_warmup_iters = 0
    pretrain(cfg)
    iter_dir = tmp_path / "run" / "ckpt" / "iter_0000001"
    record = json.loads((iter_dir / MODEL_FAMILY_IN_CHECKPOINT).read_text())
    assert record == {"family": "mistral", "architecture": "MistralForCausalLM"}
    assert model_family(load_checkpoint_config(cfg.checkpoint.save).cfg) == "mistral"

    out = tmp_path / "out"
    assert main(["convert", "export", "--checkpoint", cfg.checkpoint.save, "--output", str(out), "--no-progress"]) == 0
    assert _architecture(out) == ["MistralForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    loaded = load_model_from_checkpoint(cfg.checkpoint.save)
    tokens = torch.randint(0, 255, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded.model[0](tokens)[..., : hf.config.vocab_size]
    assert (ours - hf_logits(hf, tokens)).abs().max().item() <= 1e-5

    # Without the record (a checkpoint written before checkpoints recorded it): the inferred family, logged.
    (iter_dir / MODEL_FAMILY_IN_CHECKPOINT).unlink()
    old = tmp_path / "old"
    capsys.readouterr()
    assert main(["convert", "export", "--checkpoint", cfg.checkpoint.save, "--output", str(old), "--no-progress"]) == 0
    assert _architecture(old) == ["LlamaForCausalLM"]
    assert capsys.readouterr().out.count("no recorded model family: exporting as LlamaForCausalLM") == 1


def test_an_imported_checkpoint_records_the_hf_family(tmp_path):
    src, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    make_hf_model("qwen2", src)
    assert main(["convert", "import", "--hf-model", str(src), "--output", str(ckpt), "--no-progress"]) == 0
    record = json.loads((ckpt / "iter_0000000" / MODEL_FAMILY_IN_CHECKPOINT).read_text())
    assert record == {"family": "qwen2", "architecture": "Qwen2ForCausalLM"}
