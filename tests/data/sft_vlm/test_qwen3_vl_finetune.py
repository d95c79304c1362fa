"""Finetuning a tiny random Qwen3-VL through the VLM recipes on drawn squares mixed with conversations without an
image: the recipe's placeholder becomes the checkpoint's Qwen3-VL, a LoRA finetune from the command line lowers
the validation loss, and its merged export loads in transformers, scores the validation set as longspan did and
answers an image question as ``longspan generate --image`` does from the checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.data.sft_vlm.conftest import qwen_colour_rows, write_jsonl
from tests.helpers.vlm import finetune_case, qwen_vl_lora_learns_and_exports_alike, vlm_sft_config


@pytest.fixture(scope="module")
def qwen3_vl_run_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Qwen3-VL HF directory and colour questions, half of them (in pairs) without an image."""
    from tests.models.vlm.qwen3_vl_fixtures import make_qwen3_vl

    root = tmp_path_factory.mktemp("qwen3-vl-run")
    hf, data = root / "hf", root / "data"
    hf.mkdir()
    make_qwen3_vl(hf)
    # consecutive pairs without an image: some microbatches hold none
    rows = qwen_colour_rows(str(data), 24, seed=1, text_only=lambda i: i % 4 >= 2)
    write_jsonl(str(data / "training.jsonl"), rows[:16])
    write_jsonl(str(data / "validation.jsonl"), rows[16:])
    return hf, data


def test_the_recipe_placeholder_becomes_the_checkpoints_qwen3_vl(qwen3_vl_run_inputs):
    from longspan.recipes.loading import load_config
    from longspan.training.checkpointing.hf_weights import apply_hf_model_config

    hf, _ = qwen3_vl_run_inputs
    for recipe in ("vlm-sft", "vlm-lora"):
        cfg = load_config(recipe, overrides=["model.freeze_vision_model=true", "model.seq_length=24"])
        apply_hf_model_config(cfg, hf)
        model = cfg.model
        assert type(model).__name__ == "Qwen3VLModelProvider" and model.qk_layernorm
        assert (model.freeze_vision_model, model.seq_length) == (True, 24)
        assert model.vision_config["deepstack_visual_indexes"] == [0, 2] and model.mrope_section == [4, 2, 2]


def test_lora_finetune_from_the_cli_learns_and_its_merged_export_scores_and_answers_alike(qwen3_vl_run_inputs,
                                                                                          tmp_path):
    import transformers

    hf, data = qwen3_vl_run_inputs
    qwen_vl_lora_learns_and_exports_alike(transformers.Qwen3VLForConditionalGeneration, hf, data, tmp_path, iters=16)


LAYOUT_ITERS = 8  # the acceptance's 8 iterations
REL = 1e-5  # fp32 CPU layout parity
# FSDP2, tensor parallel (the encoder and mergers replicated) with sequence parallel, context parallel (the
# DeepStack features cut along the sequence with the embeddings) and pipeline parallel (encoder, mergers and the
# two DeepStack layers on the first stage, the third layer on the second)
LAYOUTS = {"fsdp2": ["dist.use_torch_fsdp2=true"],
           "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
           "cp2": ["model.context_parallel_size=2"],
           "pp2": ["model.pipeline_model_parallel_size=2", "model.num_layers_in_first_pipeline_stage=2"]}


def _sft_config(hf: Path, data: Path, out: Path, layout: tuple[str, ...] = ()):
    return vlm_sft_config(hf, data, out, LAYOUT_ITERS, 3e-4, extra=layout)


@pytest.fixture(scope="module")
def qwen3_vl_video_run_inputs(qwen3_vl_run_inputs, tmp_path_factory) -> tuple[Path, Path]:
    """The run's Qwen3-VL with a video processor, and its rows (pairs without an image) with a video beside an
    image in each pair that has one: video frames, or a decoded clip (5 frames at 2 fps: its last sampled frame
    repeated)."""
    import shutil

    from tests.data.sft_vlm.video_fixtures import add_video_processor, encode_video, video_frames, video_row

    root = tmp_path_factory.mktemp("qwen3-vl-video-run")
    hf, data = root / "hf", root / "data"
    shutil.copytree(qwen3_vl_run_inputs[0], hf)
    add_video_processor(hf)
    rows = qwen_colour_rows(str(data), 24, seed=1, text_only=lambda i: i % 4 >= 2)
    encode_video(data / "clip.mp4", 5, 2)
    for i in range(0, 24, 8):
        rows[i + 1] = video_row(video_frames(data, f"frames{i}", 4, (64, 64), seed=i), fps=2)
        rows[i + 4] = video_row("clip.mp4", answer="blue")
    write_jsonl(str(data / "training.jsonl"), rows[:16])
    write_jsonl(str(data / "validation.jsonl"), rows[16:])
    return hf, data


@pytest.mark.slow
def test_qwen3_vl_layouts_with_videos_and_text_only_microbatches_log_the_losses_of_one_process(
        qwen3_vl_video_run_inputs, tmp_path, pool2):
    """Every rank's microbatches mix image questions, video questions and text-only ones (those run the encoder
    and mergers on a blank image times 0); DeepStack's features reach the first two layers in every layout, and
    the video grids number the mRoPE positions on every stage and shard."""
    from tests.training.pretrain_helpers import losses_by_iteration

    hf, data = qwen3_vl_video_run_inputs
    reference = _sft_config(hf, data, tmp_path / "one")
    finetune_case(reference)
    want = losses_by_iteration(reference)
    assert sorted(want) == list(range(1, LAYOUT_ITERS + 1)) and want[LAYOUT_ITERS] < want[1]
    for layout, overrides in LAYOUTS.items():
        cfg = _sft_config(hf, data, tmp_path / layout, tuple(overrides))
        pool2.run(finetune_case, cfg, timeout=300)
        got = losses_by_iteration(cfg)
        assert sorted(got) == sorted(want)
        for it in want:
            assert math.isclose(got[it], want[it], rel_tol=REL), f"{layout} iteration {it}: {got[it]} vs {want[it]}"
