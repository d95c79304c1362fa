"""load_model_from_checkpoint: a pretrain checkpoint comes back as the same model, tokenizer and config."""

from __future__ import annotations

import shutil

import pytest
import torch

from longspan.core.errors import CheckpointError, ConfigError
from longspan.training.checkpointing.model_loading import load_model_from_checkpoint
from tests.inference.helpers import train_tiny_checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trained")
    root, model, cfg = train_tiny_checkpoint(tmp, iters=3)
    return root, model, cfg


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(tokens)


def test_reload_from_save_root_gives_the_trained_model(trained):
    root, trained_model, cfg = trained
    loaded = load_model_from_checkpoint(root)
    assert loaded.iteration == 3 and loaded.directory.name == "iter_0000003"
    assert len(loaded.model) == 1 and not loaded.model[0].training
    assert loaded.cfg.model.hidden_size == cfg.model.hidden_size and loaded.cfg.model.hidden_dropout == 0.1
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    # Bit-identical: the same weights and the same maths (the trained model switched to eval mode, so
    # dropout is off in both).
    torch.testing.assert_close(_logits(loaded.model[0], tokens), _logits(trained_model, tokens), rtol=0, atol=0)
    # Every parameter was loaded (none left as uninitialized memory).
    trained_sd = trained_model.state_dict()
    for name, tensor in loaded.model[0].state_dict().items():
        assert torch.equal(tensor, trained_sd[name]), name


def test_reload_from_iter_dir_and_tokenizer_from_checkpoint(trained, tmp_path):
    root, _, cfg = trained
    # The checkpoint carries its tokenizer: the original files may be gone.
    moved = tmp_path / "moved"
    shutil.copytree(root, moved)
    loaded = load_model_from_checkpoint(moved / "iter_0000003")
    assert loaded.iteration == 3
    assert loaded.cfg.tokenizer.tokenizer_model == str(moved / "iter_0000003" / "tokenizer")
    from longspan.data.tokenizers import build_tokenizer

    original = build_tokenizer(cfg.tokenizer)
    text = "def f7(x): return x * 7"
    assert loaded.tokenizer.tokenize(text) == original.tokenize(text)
    assert loaded.tokenizer.eos == original.eos and loaded.tokenizer.vocab_size == original.vocab_size


def test_overrides_apply_to_the_saved_config(trained):
    root, _, _ = trained
    loaded = load_model_from_checkpoint(root, ["model.hidden_dropout=0.0", "train.micro_batch_size=1"])
    assert loaded.cfg.model.hidden_dropout == 0.0 and loaded.cfg.train.micro_batch_size == 1


def test_one_process_load_resets_the_saved_layout_and_rejects_a_layout_override(trained, tmp_path):
    root, _, _ = trained
    saved = tmp_path / "saved_tp2"
    shutil.copytree(root, saved)
    run_config = saved / "iter_0000003" / "run_config.yaml"
    text = run_config.read_text()
    assert "tensor_model_parallel_size: 1" in text
    run_config.write_text(text.replace("tensor_model_parallel_size: 1", "tensor_model_parallel_size: 2", 1))
    loaded = load_model_from_checkpoint(saved)  # trained under TP2: one process loads the whole model
    assert loaded.cfg.model.tensor_model_parallel_size == 1
    with pytest.raises(ConfigError, match="model.tensor_model_parallel_size=2"):
        load_model_from_checkpoint(root, ["model.tensor_model_parallel_size=2"])


def test_missing_and_incomplete_checkpoints_are_one_line_errors(trained, tmp_path):
    root, _, _ = trained
    with pytest.raises(CheckpointError, match="does not exist") as err:
        load_model_from_checkpoint(tmp_path / "nowhere")
    assert "\n" not in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no longspan checkpoint"):
        load_model_from_checkpoint(tmp_path / "empty")
    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    (broken / "iter_0000003" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_model_from_checkpoint(broken)
    shapes = tmp_path / "shapes"
    shutil.copytree(root, shapes)
    with pytest.raises(CheckpointError, match="shape"):
        load_model_from_checkpoint(shapes, ["model.ffn_hidden_size=96"])


def test_damaged_shard_is_a_one_line_error(trained, tmp_path):
    root, _, _ = trained
    damaged = tmp_path / "damaged"
    shutil.copytree(root, damaged)
    shard = next((damaged / "iter_0000003").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated") as err:
        load_model_from_checkpoint(damaged)
    assert "\n" not in str(err.value)
    garbage = tmp_path / "garbage"
    shutil.copytree(root, garbage)
    shard = next((garbage / "iter_0000003").glob("*.distcp"))
    shard.write_bytes(b"\x00" * shard.stat().st_size)
    with pytest.raises(CheckpointError, match="cannot be read") as err:
        load_model_from_checkpoint(garbage)
    assert "\n" not in str(err.value)
