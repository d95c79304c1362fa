"""Finetuning a tiny random Gemma 4 with images (Gemma4ForConditionalGeneration) from the CLI: ``finetune --recipe
vlm-lora`` on drawn squares mixed with conversations without an image lowers the validation loss; the merged export
loads in transformers, and its greedy answer to an image question equals ``longspan generate --image`` from the
checkpoint. FSDP2 and tensor parallel (the encoder replicated) log the losses of one process over 4 iterations
(fp32, rel 1e-5) on image questions mixed with text-only ones. A record whose image is too small to pool, or with an
audio part, is a one-line error naming the file and line, before the first step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.data.sft_vlm.conftest import write_jsonl
from tests.data.sft_vlm.gemma_fixtures import gemma_colour_rows
from tests.training.pretrain_helpers import losses_by_iteration

pytestmark = [pytest.mark.slow]

# Each turn is its parts closed by <eos> (the tiny tokenizer has no turn markers); an image is Gemma 4's <|image|>.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                 "<|image|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{{ eos_token }}{% endfor %}")


@pytest.fixture(scope="module")
def gemma4_run_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Gemma 4 VL HF directory and colour questions, every second one without an image."""
    from tests.conversion.gemma4_vlm_models import make_gemma4_vlm

    root = tmp_path_factory.mktemp("gemma4-vlm-run")
    hf, data = root / "hf", root / "data"
    hf.mkdir()
    make_gemma4_vlm(hf, vision_layers=1, embedding_std=0.5)
    (hf / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    rows = gemma_colour_rows(str(data), 24, seed=1, text_only_every=2)
    write_jsonl(str(data / "training.jsonl"), rows[:16])
    write_jsonl(str(data / "validation.jsonl"), rows[16:])
    return hf, data


def _args(hf: Path, data: Path, out: Path) -> list[str]:
    return ["finetune", "--recipe", "vlm-lora", f"checkpoint.pretrained_checkpoint={hf}",
            f"dataset.dataset_root={data}", f"checkpoint.save={out}", f"checkpoint.load={out}",
            f"logger.tensorboard_dir={out}/tb", "model.seq_length=96", "train.train_iters=16",
            "train.eval_interval=8", "train.eval_iters=2", "train.global_batch_size=4", "train.micro_batch_size=2",
            "optimizer.lr=1e-2", "scheduler.lr_warmup_iters=2", "peft.dim=8", "peft.alpha=16",
            "checkpoint.save_interval=16"]


def test_gemma4_lora_from_the_cli_learns_and_its_merged_export_answers_alike(gemma4_run_inputs, tmp_path):
    import torch
    import transformers

    from longspan.data.sft.multimodal import load_processor, open_image
    from tests.test_finetune_e2e import _run_here

    hf, data = gemma4_run_inputs
    out, export = tmp_path / "run", tmp_path / "export"
    _run_here(_args(hf, data, out), cwd=tmp_path)
    records = [json.loads(x) for x in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["losses"]["lm loss"] for r in records if r.get("phase") == "validation"]
    assert len(valid) == 2 and valid[1] < valid[0] - 0.2, valid

    _run_here(["convert", "export", "--checkpoint", str(out), "--output", str(export)], cwd=tmp_path)
    assert json.loads((export / "config.json").read_text())["architectures"] == ["Gemma4ForConditionalGeneration"]
    rows = [json.loads(line) for line in (data / "validation.jsonl").read_text().splitlines()]
    image = data / next(r for r in rows if r["messages"][0]["content"][0]["type"] == "image")["messages"][0][
        "content"][0]["image"]
    prompt = "<bos><|image|>the picture<eos>"
    printed = _run_here(["generate", "--checkpoint", str(out), "--image", str(image), "--prompt", prompt,
                         "--max-new-tokens", "3", "--json"], cwd=tmp_path)
    ours = json.loads(printed.strip().splitlines()[-1])
    inputs = load_processor(str(export))(text=prompt, images=[open_image(str(image), None, "test")],
                                         return_tensors="pt")
    assert ours["prompt_ids"] == inputs["input_ids"][0].tolist()
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(str(export), attn_implementation="eager")
    with torch.no_grad():
        theirs = model.eval().generate(**inputs, do_sample=False, max_new_tokens=3, eos_token_id=None, pad_token_id=0)
    assert ours["output_ids"] and ours["output_ids"] == theirs[0, inputs["input_ids"].shape[1]:].tolist()[
        : len(ours["output_ids"])]


def test_an_image_too_small_to_pool_or_an_audio_part_stops_the_run_before_its_first_step(gemma4_run_inputs, tmp_path,
                                                                                        capsys):
    from PIL import Image

    from longspan.cli import main

    hf, data = gemma4_run_inputs
    small_hf, bad = tmp_path / "hf", tmp_path / "data"
    small_hf.mkdir()
    for f in hf.iterdir():
        (small_hf / f.name).write_bytes(f.read_bytes())
    config = json.loads((small_hf / "processor_config.json").read_text())
    config["image_processor"]["do_resize"] = False  # the image reaches the model at its own size
    (small_hf / "processor_config.json").write_text(json.dumps(config))
    rows = gemma_colour_rows(str(bad), 4, seed=2)
    Image.new("RGB", (16, 16), (20, 200, 20)).save(bad / "good.png")  # 4x4 patches: 2x2 soft tokens
    Image.new("RGB", (8, 4), (200, 20, 20)).save(bad / "tiny.png")  # 2x1 patches: not one 2x2 square
    for i, row in enumerate(rows):
        row["messages"][0]["content"][0]["image"] = "tiny.png" if i == 2 else "good.png"
    write_jsonl(str(bad / "training.jsonl"), rows)
    write_jsonl(str(bad / "validation.jsonl"), rows[:1])
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(_args(small_hf, bad, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad / 'training.jsonl'} line 3: image 1 is 2x1 patches, too small" in err[0], err
    assert not (out / "tb" / "metrics.jsonl").exists()

    # An audio part: one line naming the file and line, before the first step.
    rows[2]["messages"][0]["content"][0] = {"type": "audio", "audio": "speech.wav"}
    write_jsonl(str(bad / "training.jsonl"), rows)
    assert main(_args(hf, bad, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad / 'training.jsonl'} line 3: audio parts are not supported yet" in err[0], err
    assert not (out / "tb" / "metrics.jsonl").exists()


ITERS = 4


def _sft_config(hf: Path, data: Path, out: Path, tp: int = 1, fsdp: bool = False):
    from longspan.recipes.loading import load_config

    return load_config("vlm-sft", overrides=[
        f"checkpoint.pretrained_checkpoint={hf}", f"dataset.dataset_root={data}", "checkpoint.save=null",
        "checkpoint.load=null", f"logger.tensorboard_dir={out}/tb", "logger.log_interval=1", "model.seq_length=96",
        f"train.train_iters={ITERS}", "train.eval_iters=0", "train.global_batch_size=4", "train.micro_batch_size=2",
        "optimizer.lr=1e-3", "scheduler.lr_warmup_iters=0", "dist.distributed_backend=gloo",
        "dist.distributed_timeout_minutes=1", f"model.tensor_model_parallel_size={tp}", f"dist.use_torch_fsdp2={fsdp}",
    ])


def _finetune_each(cfgs: list) -> int:
    from longspan.training.finetune import finetune

    for cfg in cfgs:
        finetune(cfg)
    return 0


def test_fsdp2_and_tensor_parallel_log_the_losses_of_one_process(gemma4_run_inputs, tmp_path, pool2):
    """Every second conversation has no image (a microbatch without one runs the encoder on a blank image times 0,
    so every rank reduces the same gradients). Both layouts run in one call of the shared two-process pool."""
    hf, data = gemma4_run_inputs
    one = _sft_config(hf, data, tmp_path / "one")
    _finetune_each([one])
    layouts = {"fsdp2": _sft_config(hf, data, tmp_path / "fsdp2", fsdp=True),
               "tp2": _sft_config(hf, data, tmp_path / "tp2", tp=2)}
    pool2.run(_finetune_each, list(layouts.values()), timeout=300)
    want = losses_by_iteration(one)
    assert sorted(want) == list(range(1, ITERS + 1)) and want[ITERS] < want[1]
    for layout, cfg in layouts.items():
        got = losses_by_iteration(cfg)
        assert sorted(got) == sorted(want), layout
        for it in want:
            assert math.isclose(got[it], want[it], rel_tol=1e-5), f"{layout} iteration {it}: {got[it]} vs {want[it]}"
