"""tiny-mamba / tiny-hybrid through pretrain(): the loss falls, and stop-and-resume is bit-exact (dropout on)."""

from __future__ import annotations

from pathlib import Path

import pytest

from longspan.models.mamba import MambaModel
from longspan.training.step.forward_step import forward_step
from longspan.training.pretrain import pretrain
from tests.models.mamba.mamba_test_config import small_mamba_run
from tests.training.pretrain_helpers import losses_by_iteration


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tiny-mamba", "tiny-hybrid"])
def test_recipe_trains_and_resumes_bit_for_bit(tmp_path: Path, recipe: str) -> None:
    straight = small_mamba_run(tmp_path, recipe, "straight", dropout=0.1)
    state = pretrain(straight, forward_step)
    reference = losses_by_iteration(straight)
    assert sorted(reference) == list(range(1, 13))
    assert sum(reference[i] for i in (10, 11, 12)) < sum(reference[i] for i in (1, 2, 3)) - 0.3
    assert state.train_state.step == 12

    _check_saved_model_loads_and_exports(straight, recipe, tmp_path)

    stopped = small_mamba_run(tmp_path, recipe, "resumed", dropout=0.1, exit_interval=5)
    assert pretrain(stopped, forward_step).train_state.step == 5
    resumed_cfg = small_mamba_run(tmp_path, recipe, "resumed", dropout=0.1)
    pretrain(resumed_cfg, forward_step)
    resumed = losses_by_iteration(resumed_cfg)
    assert [resumed[i] for i in range(1, 13)] == [reference[i] for i in range(1, 13)]


def test_recipes_build_mamba_models() -> None:
    from longspan.recipes import get_recipe

    for recipe, pattern in (("tiny-mamba", "MMMM"), ("tiny_hybrid", "M*M-")):
        cfg = get_recipe(recipe)
        cfg.model.finalize()
        model = cfg.model.provide_meta()
        assert isinstance(model, MambaModel)
        assert "".join(model.args.layer_types) == pattern


def _check_saved_model_loads_and_exports(cfg, recipe: str, tmp_path: Path) -> None:
    """The trained checkpoint rebuilds as a MambaModel (load_model_from_checkpoint), generates, and exports to
    the matching HF architecture, which transformers loads with the same logits."""
    import torch
    import transformers

    from longspan.conversion import AutoBridge
    from longspan.inference.text_generation import generate
    from longspan.training.checkpointing.model_loading import load_model_from_checkpoint

    loaded = load_model_from_checkpoint(cfg.checkpoint.save, device="cpu")
    (model,) = loaded.model
    assert isinstance(model, MambaModel) and loaded.iteration == 12
    assert len(generate(model, loaded.tokenizer, [3, 7, 11], max_new_tokens=4).output_ids) == 4
    bridge = AutoBridge.from_longspan_provider(loaded.cfg.model)
    assert bridge.family.architecture == ("Mamba2ForCausalLM" if recipe == "tiny-mamba" else "NemotronHForCausalLM")
    bridge.save_hf_pretrained([model], tmp_path / f"{recipe}-hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / f"{recipe}-hf")).eval()
    ids = torch.randint(0, 200, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)[..., : hf.config.vocab_size]
        assert (hf(ids).logits - ours).abs().max().item() <= 1e-5
