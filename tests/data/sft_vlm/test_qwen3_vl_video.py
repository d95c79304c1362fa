"""Videos for Qwen3-VL (and Qwen3.5, the same processor) in multimodal SFT data and ``longspan generate --video``.

transformers' video processor needs torchvision, which cannot be installed here, so the oracle is what runs:
transformers' ``smart_resize`` and ``sample_frames`` (called on their own), its Qwen2-VL image processor (a clip
of two equal frames is the image's patches), its ``Qwen3VLProcessor`` writing the prompt (timestamps, one
``<|video_pad|>`` per merged patch) from longspan's outputs, and its ``Qwen3VLForConditionalGeneration`` (logits,
greedy generate) on longspan's processed video. Timestamps and frame choices are also checked against values
worked out by hand. Bad videos are one-line errors naming the file and line.
"""

from __future__ import annotations

import importlib
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from longspan.core.errors import ConfigError, DataError
from longspan.data.sft.dataset import EpochSampleMap
from longspan.data.sft.formatting import SFTFormatOptions
from longspan.data.sft.multimodal import build_multimodal_jsonl_split, load_processor
from longspan.families.qwen3_vl.video import Qwen3VLVideoPreprocessor, smart_resize
from tests.data.sft_vlm.conftest import write_jsonl
from tests.data.sft_vlm.video_fixtures import (VIDEO_SETTINGS, add_video_processor, encode_video, video_frames,
                                              video_row)


@pytest.fixture(scope="module")
def video_model(tmp_path_factory):
    """(HF directory with a video processor config and a video-aware template, transformers' model, longspan's
    model, data directory with frames and an mpeg4 file)."""
    from longspan import AutoBridge
    from tests.models.vlm.qwen3_vl_fixtures import make_qwen3_vl

    root = tmp_path_factory.mktemp("qwen3-vl-video")
    hf_dir, data = root / "hf", root / "data"
    hf_dir.mkdir()
    hf = make_qwen3_vl(hf_dir)
    add_video_processor(hf_dir)
    data.mkdir()
    encode_video(data / "clip.mp4", 10, 5)
    model = AutoBridge.from_hf_pretrained(hf_dir).to_megatron_model()[0].eval()
    return hf_dir, hf, model, data


def test_preprocessing_equals_transformers_helpers_and_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    # the module itself: ``transformers.models.qwen3_vl``'s lazy attribute is a torchvision placeholder
    hf_video = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    from transformers.video_utils import VideoMetadata

    for t, h, w in [(2, 50, 70), (4, 20, 300), (8, 480, 640), (6, 33, 33), (16, 1080, 1920)]:
        for lo, hi in [(32 * 32, 32 * 32 * 64), (128 * 32 * 32, 32 * 32 * 768)]:
            assert smart_resize(t, h, w, 2, 32, lo, hi) == hf_video.smart_resize(t, h, w, 2, 32, lo, hi)
    pre = Qwen3VLVideoPreprocessor.from_settings(VIDEO_SETTINGS, "test")
    hf_self = SimpleNamespace(fps=pre.fps, min_frames=pre.min_frames, max_frames=pre.max_frames)
    for total, fps in [(10, 5.0), (300, 30.0), (7, 24.0), (3, 1.0), (1000, 10.0)]:
        hf_indices = hf_video.Qwen3VLVideoProcessor.sample_frames(hf_self, VideoMetadata(total, fps=fps)).tolist()
        # transformers' preprocessing then repeats the last sampled frame up to whole temporal patches
        assert pre.frame_indices(total, fps) == hf_indices + hf_indices[-1:] * (len(hf_indices) % 2)
    assert pre.frame_indices(5, 2.0) == [0, 1, 2, 3, 4, 4]  # 5 sampled: the last one repeated
    assert pre.frame_indices(10, 5.0) == [0, 3, 6, 9]  # 4 frames (2 s at 2 fps) from 0 to 9
    with pytest.raises(ConfigError, match="video processor setting num_frames=8 is not supported yet"):
        Qwen3VLVideoPreprocessor.from_settings({**VIDEO_SETTINGS, "num_frames": 8}, "video_preprocessor_config.json")
    # a clip of one image twice is that image's patches (resized 70x50 -> 64x64 by both)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (50, 70, 3), dtype=np.uint8))
    patches, grid = pre.preprocess(np.stack([np.asarray(image)] * 2))
    oracle = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=32 * 32 * 32, patch_size=16, merge_size=2,
                                      temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    out = oracle(images=[image], return_tensors="pt")
    assert grid == out["image_grid_thw"][0].tolist() == [1, 4, 4]
    torch.testing.assert_close(patches, out["pixel_values"], rtol=0, atol=1e-5)


def test_video_rows_give_transformers_logits_and_train_only_the_answer(video_model, tmp_path):
    hf_dir, hf, model, data = video_model
    frames = video_frames(tmp_path, "frames", 4, (64, 64), seed=3)
    shutil.copy(data / "clip.mp4", tmp_path / "clip.mp4")
    path = write_jsonl(str(tmp_path / "train.jsonl"), [video_row(frames, fps=2), video_row("clip.mp4", answer="blue")])
    processor = load_processor(str(hf_dir))
    split = build_multimodal_jsonl_split(path, processor, SFTFormatOptions(), 160,
                                         lambda n: EpochSampleMap(n, n, 0, False), 0)
    video_id = hf.config.video_token_id
    for i, answer, grid in ((0, "red", [2, 4, 4]), (1, "blue", [2, 4, 4])):
        sample = split[i]
        assert sample["video_grid_thw"].tolist() == [grid]
        tokens = torch.cat([sample["tokens"], sample["labels"][-1:]])
        assert int((tokens == video_id).sum()) == 2 * 4  # one token per merged patch of each frame pair
        # the loss covers the answer and its end token only (labels are the tokens shifted by one)
        trained = processor.tokenizer.convert_ids_to_tokens(sample["labels"][sample["loss_mask"] > 0].tolist())
        assert trained == [answer, "<|im_end|>"]
        ids = sample["tokens"][None]
        kinds = (ids == hf.config.image_token_id).int() + 2 * (ids == video_id).int()
        videos = {k: sample[k] for k in ("pixel_values_videos", "video_grid_thw")}
        with torch.no_grad():
            expected = hf(input_ids=ids, mm_token_type_ids=kinds, **videos).logits
            ours = model(ids, **videos)
            blank = model(ids, pixel_values_videos=torch.zeros_like(videos["pixel_values_videos"]),
                          video_grid_thw=videos["video_grid_thw"])
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
        assert (blank - ours).abs().max() > 1e-2
    # the prompt transformers' processor writes from the outputs: the mean time of each frame pair, by hand
    pre = processor.video_processor
    for source, fps, indices, stamps in (("frames", 2.0, [0, 1, 2, 3], ["0.2", "1.2"]),
                                         ("clip", 5.0, [0, 3, 6, 9], ["0.3", "1.5"])):
        meta = SimpleNamespace(fps=fps, frames_indices=indices)
        out = pre([np.zeros((4, 64, 64, 3), np.uint8)], video_metadata=[meta], return_metadata=True)
        frame = "<|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>"
        assert processor.replace_video_token(out, 0) == "".join(f"<{s} seconds>{frame}" for s in stamps), source
    # a decoded clip whose sampled frames are odd (5 frames, 2.5 s at 2 fps) repeats its last frame, as
    # transformers' preprocessing does: three temporal patches, the last of one frame twice
    encode_video(tmp_path / "odd.mp4", 5, 2)
    odd = write_jsonl(str(tmp_path / "odd.jsonl"), [video_row("odd.mp4")])
    sample = build_multimodal_jsonl_split(odd, processor, SFTFormatOptions(), 160,
                                          lambda n: EpochSampleMap(n, n, 0, False), 0)[0]
    assert sample["video_grid_thw"].tolist() == [[3, 4, 4]]


def test_bad_videos_are_one_line_errors_naming_file_and_line(video_model, vl_processor_dir, tmp_path):
    hf_dir, _, _, _ = video_model
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    cases = [
        (video_row(video_frames(tmp_path, "odd", 3, (64, 64), seed=1), fps=2), "has 3 frame\\(s\\), which its temporal patch"),
        (video_row(video_frames(tmp_path, "tiny", 2, (16, 24), seed=2), fps=2), "16x24 pixels, smaller than one merged patch"),
        (video_row("broken.mp4"), "video .*broken.mp4 cannot be read"),
        (video_row("missing.mp4"), "video .*missing.mp4 does not exist"),
        (video_row(video_frames(tmp_path, "nofps", 2, (64, 64), seed=3)), "needs \"fps\""),
    ]
    processor = load_processor(str(hf_dir))
    good = video_row(video_frames(tmp_path, "good", 2, (64, 64), seed=4), fps=1)
    for k, (row, message) in enumerate(cases):
        path = write_jsonl(str(tmp_path / f"bad{k}.jsonl"), [good, row])
        with pytest.raises(DataError, match=f"bad{k}.jsonl line 2: .*{message}") as info:
            build_multimodal_jsonl_split(path, processor, SFTFormatOptions(), 160,
                                         lambda n: EpochSampleMap(n, n, 0, False), 0)
        assert "\n" not in str(info.value)
    # Qwen2.5-VL's processor (its model has no video path in longspan)
    path = write_jsonl(str(tmp_path / "qwen25.jsonl"), [good])
    with pytest.raises(DataError, match="qwen25.jsonl line 1: .*Qwen2_5_VLProcessor has no video path"):
        build_multimodal_jsonl_split(path, load_processor(vl_processor_dir), SFTFormatOptions(), 160,
                                     lambda n: EpochSampleMap(n, n, 0, False), 0)
    # Qwen3.5's processor is Qwen3-VL's: the same video path
    qwen35 = tmp_path / "qwen35"
    shutil.copytree(hf_dir, qwen35, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((qwen35 / "config.json").read_text())
    (qwen35 / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5"}))
    assert isinstance(load_processor(str(qwen35)).video_processor, Qwen3VLVideoPreprocessor)


def test_generate_cli_with_a_video_equals_transformers(video_model, tmp_path, capsys):
    from longspan.cli import main
    from longspan.inference.video_generation import video_prompt_inputs

    hf_dir, hf, _, _ = video_model
    video_frames(tmp_path, "frames", 4, (64, 96), seed=5)
    prompt = "<|im_start|>user\nwhat colour<|im_end|>\n<|im_start|>assistant\n"
    capsys.readouterr()
    code = main(["generate", "--hf-model", str(hf_dir), "--video", str(tmp_path / "frames"), "--video-fps", "2",
                 "--prompt", prompt, "--max-new-tokens", "5", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    ids, inputs = video_prompt_inputs(load_processor(str(hf_dir)), prompt, [tmp_path / "frames"], 2.0)
    assert result["prompt_ids"] == ids and inputs["video_grid_thw"].tolist() == [[2, 6, 4]]
    prompt_ids = torch.tensor([ids])
    kinds = 2 * (prompt_ids == hf.config.video_token_id).int()
    out = hf.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), mm_token_type_ids=kinds,
                      do_sample=False, max_new_tokens=5, min_new_tokens=5, eos_token_id=None, pad_token_id=0, **inputs)
    assert result["output_ids"] == out[0, len(ids):].tolist()
    # a model whose forward takes no videos (Qwen2.5-VL's, Gemma's) is refused before the processor runs
    from longspan.core.errors import NotSupportedError
    from longspan.inference.video_generation import check_video_model

    with pytest.raises(NotSupportedError, match="--video: Linear has no video path"):
        check_video_model(torch.nn.Linear(1, 1), "--video")
    # bad input at the command line: one line, exit 2
    code = main(["generate", "--hf-model", str(hf_dir), "--video", str(tmp_path / "nothing.mp4"), "--prompt", prompt])
    assert code == 2 and "--video" in capsys.readouterr().err


@pytest.mark.slow
def test_finetune_steps_on_video_rows_and_a_bad_row_stops_before_the_first(video_model, tmp_path, capsys):
    """SFT steps on video rows from the command line: the first step's loss is transformers' on the processed
    video (the pixels and the video's mRoPE positions reach the model; the answer alone is trained); a row whose
    video has an odd frame count stops the run with exit 2 and one line naming the file and line, nothing
    written."""
    from longspan.cli import main
    from tests.test_finetune_e2e import _run_here

    hf_dir, hf, _, _ = video_model
    data = tmp_path / "data"
    row = video_row(video_frames(data, "v", 4, (64, 64), seed=10), fps=2)
    write_jsonl(str(data / "training.jsonl"), [row] * 4)
    write_jsonl(str(data / "validation.jsonl"), [row])
    out = tmp_path / "run"
    common = ["finetune", "--recipe", "vlm-sft", f"checkpoint.pretrained_checkpoint={hf_dir}",
              f"dataset.dataset_root={data}", f"checkpoint.save={out}", f"logger.tensorboard_dir={out}/tb",
              "model.seq_length=64", "train.train_iters=2", "train.eval_interval=2", "train.eval_iters=1",
              "train.global_batch_size=2", "train.micro_batch_size=1", "checkpoint.save_interval=100"]
    _run_here(common, cwd=tmp_path)
    records = [json.loads(x) for x in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r.get("phase") == "train")
    sample = build_multimodal_jsonl_split(str(data / "training.jsonl"), load_processor(str(hf_dir)),
                                          SFTFormatOptions(), 64, lambda n: EpochSampleMap(n, n, 0, False), 0)[0]
    ids = sample["tokens"][None]
    with torch.no_grad():
        logits = hf(input_ids=ids, mm_token_type_ids=2 * (ids == hf.config.video_token_id).int(),
                    pixel_values_videos=sample["pixel_values_videos"], video_grid_thw=sample["video_grid_thw"]).logits
    losses = torch.nn.functional.cross_entropy(logits[0], sample["labels"], reduction="none")
    expected = float((losses * sample["loss_mask"]).sum() / sample["loss_mask"].sum())
    assert first["loss_tokens"] == 2 * 2  # answer and end token of each of the step's 2 samples
    assert first["losses"]["lm loss"] == pytest.approx(expected, rel=1e-4)
    write_jsonl(str(data / "training.jsonl"), [row, video_row(video_frames(data, "odd", 3, (64, 64), seed=1), fps=2)])
    bad = tmp_path / "bad-run"
    capsys.readouterr()
    code = main([*common[:5], f"checkpoint.save={bad}", f"logger.tensorboard_dir={bad}/tb", *common[7:]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not bad.exists(), err
    assert "training.jsonl line 2: video 1 has 3 frame(s)" in err[-1]
