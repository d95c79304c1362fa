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
from tests.data.sft_vlm.gemma_fixtures import gemma_colour_rows, make_gemma4_vl_dir
from tests.helpers.vlm import (assert_answers_alike, cli_image_answer, finetune_each, lora_cli_args, run_cli,
                               validation_losses, vlm_sft_config)
from tests.training.pretrain_helpers import losses_by_iteration

pytestmark = [pytest.mark.slow]



@pytest.fixture(scope="module")
def gemma4_run_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Gemma 4 VL HF directory and colour questions, every second one without an image."""
    root = tmp_path_factory.mktemp("gemma4-vlm-run")
    hf, data = make_gemma4_vl_dir(root / "hf"), root / "data"
    rows = gemma_colour_rows(str(data), 24, seed=1, text_only_every=2)
    write_jsonl(str(data / "training.jsonl"), rows[:16])
    write_jsonl(str(data / "validation.jsonl"), rows[16:])
    return hf, data


def _args(hf: Path, data: Path, out: Path) -> list[str]:
    return lora_cli_args(hf, data, out, iters=16, lr=1e-2, seq_length=96)


def test_gemma4_lora_from_the_cli_learns_and_its_merged_export_answers_alike(gemma4_run_inputs, tmp_path):
    import torch
    import transformers

    from longspan.data.sft.multimodal import load_processor, open_image

    hf, data = gemma4_run_inputs
    out, export = tmp_path / "run", tmp_path / "export"
    run_cli(_args(hf, data, out), tmp_path)
    valid = validation_losses(out)
    assert len(valid) == 2 and valid[1] < valid[0] - 0.2, valid

    run_cli(["convert", "export", "--checkpoint", str(out), "--output", str(export)], tmp_path)
    assert json.loads((export / "config.json").read_text())["architectures"] == ["Gemma4ForConditionalGeneration"]
    prompt = "<bos><|image|>the picture<eos>"
    ours, image = cli_image_answer(out, data, prompt, tmp_path)
    inputs = load_processor(str(export))(text=prompt, images=[open_image(str(image), None, "test")],
                                         return_tensors="pt")
    assert ours["prompt_ids"] == inputs["input_ids"][0].tolist()
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(str(export), attn_implementation="eager")
    with torch.no_grad():
        theirs = model.eval().generate(**inputs, do_sample=False, max_new_tokens=3, eos_token_id=None, pad_token_id=0)
    assert_answers_alike(ours, theirs[0, inputs["input_ids"].shape[1]:].tolist())


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
    return vlm_sft_config(hf, data, out, ITERS, 1e-3, seq_length=96, extra=[
        f"model.tensor_model_parallel_size={tp}", f"dist.use_torch_fsdp2={fsdp}"])




def test_fsdp2_and_tensor_parallel_log_the_losses_of_one_process(gemma4_run_inputs, tmp_path, pool2):
    """Every second conversation has no image (a microbatch without one runs the encoder on a blank image times 0,
    so every rank reduces the same gradients). Both layouts run in one call of the shared two-process pool."""
    hf, data = gemma4_run_inputs
    one = _sft_config(hf, data, tmp_path / "one")
    finetune_each([one])
    layouts = {"fsdp2": _sft_config(hf, data, tmp_path / "fsdp2", fsdp=True),
               "tp2": _sft_config(hf, data, tmp_path / "tp2", tp=2)}
    pool2.run(finetune_each, list(layouts.values()), timeout=300)
    want = losses_by_iteration(one)
    assert sorted(want) == list(range(1, ITERS + 1)) and want[ITERS] < want[1]
    for layout, cfg in layouts.items():
        got = losses_by_iteration(cfg)
        assert sorted(got) == sorted(want), layout
        for it in want:
            assert math.isclose(got[it], want[it], rel_tol=1e-5), f"{layout} iteration {it}: {got[it]} vs {want[it]}"
