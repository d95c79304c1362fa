"""``longspan convert import|export`` through ``longspan.cli.main`` (in-process) and one launched run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors import safe_open

from longspan.cli import main
from longspan.training.checkpointing.model_loading import load_model_from_checkpoint
from longspan.core.errors import CheckpointError, NotSupportedError
from tests.conversion.hf_models import VOCAB, hf_config, hf_logits, make_hf_model, read_config


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(p for p in directory.iterdir() if p.suffix == ".safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_import_then_export_round_trip(tmp_path, family, capsys):
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    hf = make_hf_model(family, src, max_shard_size="30KB")
    generation = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [1, 2]}
    (src / "generation_config.json").write_text(json.dumps(generation))  # the model's own sampling defaults
    assert main(["convert", "import", "--hf-model", str(src), "--output", str(ckpt), "--no-progress"]) == 0
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    it0 = ckpt / "iter_0000000"
    assert (it0 / "run_config.yaml").is_file() and (it0 / "tokenizer").is_dir()
    # The checkpoint loads as a model (helper B's loader) with transformers' logits.
    loaded = load_model_from_checkpoint(str(ckpt))
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (loaded.model[0](tokens) - hf_logits(hf, tokens)).abs().max().item() <= 1e-5
    layout = tmp_path / "layout.yaml"
    layout.write_text("model:\n  hidden_dropout: 0.0\n")
    assert main(["convert", "export", "--checkpoint", str(ckpt), "--output", str(out), "--no-progress",
                 "--config", str(layout)]) == 0
    original, exported = _tensors(src), _tensors(out)
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    wrong = tmp_path / "wrong.yaml"  # --config reaches the rebuilt model: a different architecture is refused
    wrong.write_text("model:\n  num_layers: 3\n")
    assert main(["convert", "export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "o2"), "--no-progress",
                 "--config", str(wrong)]) == 2
    assert json.loads((out / "config.json").read_text())["architectures"] == hf.config.architectures
    assert (out / "tokenizer.json").is_file()
    assert json.loads((out / "generation_config.json").read_text()) == generation  # kept through the round trip
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert torch.equal(hf_logits(again, tokens), hf_logits(hf, tokens))
    assert transformers.AutoTokenizer.from_pretrained(str(out)).vocab_size > 0


def test_imported_checkpoint_is_a_pretrained_checkpoint(tmp_path):
    """pretrain/finetune load the converted checkpoint (DCP path) with the HF weights."""
    from tests.conversion.test_training_from_hf import _config, _hf_loss, _recording_forward_step
    from tests.training.pretrain_helpers import losses_by_iteration
    from longspan.training.finetune import finetune

    src, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    hf = make_hf_model("qwen3", src)
    assert main(["convert", "import", "--hf-model", str(src), "--output", str(ckpt), "--no-progress",
                 "model.seq_length=48"]) == 0
    cfg = _config(tmp_path, ckpt)
    cfg.checkpoint.use_checkpoint_args = True  # architecture from the converted run_config.yaml
    cfg.dataset.sequence_length = 48  # the converted run's seq_length
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = str(src)
    cfg.model.vocab_size = None
    batches: list = []
    finetune(cfg, _recording_forward_step(batches))
    assert abs(losses_by_iteration(cfg)[1] - _hf_loss(hf, batches)) <= 1e-5


def test_tiny_checkpoint_exports_as_llama(tmp_path):
    from tests.training.pretrain_helpers import small_config
    from longspan.training.pretrain import pretrain

    cfg = small_config(tmp_path, train_iters=2, eval_interval=100, eval_iters=0)
    cfg.checkpoint.save_interval = 2
    cfg.scheduler.lr_warmup_iters = 0
    pretrain(cfg)
    out = tmp_path / "out"
    assert main(["convert", "export", "--checkpoint", cfg.checkpoint.save, "--output", str(out), "--no-progress"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert type(hf).__name__ == "LlamaForCausalLM"
    loaded = load_model_from_checkpoint(cfg.checkpoint.save)
    tokens = torch.randint(0, 255, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded.model[0](tokens)[..., : hf.config.vocab_size]
    assert (ours - hf_logits(hf, tokens)).abs().max().item() <= 1e-5


def _one_line_error(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv + ["--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_errors_are_one_line_exit_2(tmp_path, capsys):
    err = _one_line_error(capsys, ["convert", "import", "--hf-model", str(tmp_path / "nope"), "--output", str(tmp_path / "c")])
    assert "nope: no such directory" in err
    err = _one_line_error(capsys, ["convert", "export", "--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "o")])
    assert "no such directory" in err

    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    err = _one_line_error(capsys, ["convert", "import", "--hf-model", str(bert), "--output", str(tmp_path / "c")])
    assert "BertForMaskedLM is not supported" in err and "LlamaForCausalLM" in err
    (bert / "config.json").write_text("{not json")
    err = _one_line_error(capsys, ["convert", "import", "--hf-model", str(bert), "--output", str(tmp_path / "c")])
    assert "config.json is not valid JSON" in err
    (bert / "config.json").unlink()
    err = _one_line_error(capsys, ["convert", "import", "--hf-model", str(bert), "--output", str(tmp_path / "c")])
    assert "is not an HF model directory: it has no config.json" in err

    src = tmp_path / "hf"
    make_hf_model("llama", src, tokenizer=False)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, hidden_size=40, head_dim=10)))
    err = _one_line_error(capsys, ["convert", "import", "--hf-model", str(src), "--output", str(tmp_path / "c")])
    assert "shape mismatch" in err and "model.embed_tokens.weight has shape (96, 32)" in err and "(96, 40)" in err

    (src / "config.json").write_text(json.dumps(cfg))
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    err = _one_line_error(capsys, ["convert", "import", "--hf-model", str(src), "--output", str(tmp_path / "c")])
    assert "model.safetensors is truncated" in err
    f.unlink()
    err = _one_line_error(capsys, ["convert", "import", "--hf-model", str(src), "--output", str(tmp_path / "c")])
    assert "holds no model.safetensors or model.safetensors.index.json" in err
    assert not (tmp_path / "c").exists()  # nothing written for a failed import


@pytest.mark.slow
def test_launched_import_with_tensor_parallel_round_trips(tmp_path, pool2):
    """The import is launched (``--nproc-per-node 2``); the export runs the same command on the two workers of the
    shared pool, as a launched worker would (the launcher's path is the import's)."""
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    make_hf_model("llama", src)
    base = [sys.executable, "-m", "longspan", "convert"]
    run = subprocess.run(base + ["import", "--hf-model", str(src), "--output", str(ckpt), "--nproc-per-node", "2",
                                 "model.tensor_model_parallel_size=2"], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert pool2.run(main, ["convert", "export", "--checkpoint", str(ckpt), "--output", str(out), "--no-progress",
                            "model.tensor_model_parallel_size=2"], timeout=240) == [0, 0]
    original, exported = _tensors(src), _tensors(out)
    assert sorted(original) == sorted(exported) and all(torch.equal(exported[k], v) for k, v in original.items())


def test_import_ckpt_and_export_ckpt(tmp_path):
    """Megatron Bridge's checkpoint methods on ``longspan.AutoBridge``, the one conversion class."""
    import longspan.conversion
    from longspan import AutoBridge

    assert AutoBridge is longspan.conversion.AutoBridge
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    make_hf_model("qwen3_moe", src)
    AutoBridge.import_ckpt(src, ckpt)
    assert (ckpt / "iter_0000000" / "hf_config.json").is_file()
    AutoBridge.from_hf_pretrained(src).export_ckpt(ckpt, out)
    original, exported = _tensors(src), _tensors(out)
    assert sorted(original) == sorted(exported) and all(torch.equal(exported[k], v) for k, v in original.items())
    assert read_config(out) == read_config(src)  # the imported config.json, this bridge's architecture
    llama = tmp_path / "as_llama"  # another architecture: config.json from the checkpoint's model
    with pytest.raises(CheckpointError, match="router.weight has no LlamaForCausalLM equivalent"):
        AutoBridge.from_hf_config(hf_config("llama")).export_ckpt(ckpt, llama)


def test_checkpoint_methods_need_the_training_format(monkeypatch, tmp_path):
    """Without the training layer's checkpoint format plugged in, import_ckpt is a one-line error naming the fix."""
    from longspan.conversion import AutoBridge

    monkeypatch.setattr(AutoBridge, "checkpoint_format", None)
    with pytest.raises(NotSupportedError, match="from longspan import AutoBridge"):
        AutoBridge.import_ckpt(tmp_path / "hf", tmp_path / "ckpt")


def test_launched_convert_checks_the_layout_before_starting_workers(tmp_path, capsys):
    """4 heads in 2 groups cannot split over 4 tensor-parallel ranks: one line from the launcher's process, as
    pretrain says it, instead of 4 workers of which only rank 0 says why."""
    src = tmp_path / "hf"
    make_hf_model("llama", src, tokenizer=False)
    err = _one_line_error(capsys, ["convert", "import", "--hf-model", str(src), "--output", str(tmp_path / "c"),
                                   "--nproc-per-node", "4", "model.tensor_model_parallel_size=4"])
    assert "tensor_model_parallel_size=4" in err and "num_query_groups=2" in err, err
    assert "rank" not in err and not (tmp_path / "c").exists()
    assert main(["convert", "import", "--hf-model", str(src), "--output", str(tmp_path / "ckpt"), "--no-progress"]) == 0
    err = _one_line_error(capsys, ["convert", "export", "--checkpoint", str(tmp_path / "ckpt"), "--output",
                                   str(tmp_path / "o"), "--nproc-per-node", "2", "model.tensor_model_parallel_size=4"])
    assert "world size 2 is not divisible by tensor_model_parallel_size (4)" in err and "rank" not in err, err
    assert not (tmp_path / "o").exists()
