"""Finetuning a tiny random Gemma 3 VL through the VLM recipes on drawn squares mixed with conversations without
an image: FSDP2, tensor parallel (encoder replicated) and pipeline parallel (encoder on the first stage, also
interleaved over virtual stages) over two ranks log the losses of one process (fp32, rel <= 1e-5, every one of 8 iterations) although some ranks'
microbatches hold no image (they run the encoder on a blank image times 0, so every rank reduces the same
gradients); a language model with experts under EP2 does too. The data path on Gemma's processor masks
exactly transformers' assistant tokens; a CLI LoRA finetune learns, and its merged export scores and answers
(``longspan generate --image``) as longspan does."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.data.sft_vlm.conftest import moe_from_scratch, pretrain_counting_sharded_experts, write_jsonl
from tests.data.sft_vlm.gemma_fixtures import gemma_chat_template, gemma_colour_rows, make_gemma_vl_dir
from tests.helpers.vlm import (assert_answers_alike, cli_image_answer, finetune_case, gemma_sample_inputs,
                               hf_validation_loss, layout_overrides, lora_cli_args, run_cli, validation_losses,
                               vlm_sft_config)
from tests.training.pretrain_helpers import losses_by_iteration

ITERS = 8
REL = 1e-5  # fp32 CPU layout parity


@pytest.fixture(scope="module")
def gemma_run_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Gemma 3 VL HF directory and colour questions, every second one without an image."""
    root = tmp_path_factory.mktemp("gemma-vlm-run")
    hf, data = make_gemma_vl_dir(root / "hf"), root / "data"
    rows = gemma_colour_rows(str(data), 24, seed=1, text_only_every=2)
    write_jsonl(str(data / "training.jsonl"), rows[:16])
    write_jsonl(str(data / "validation.jsonl"), rows[16:])
    return hf, data


# The pipeline splits of the PP layouts: the language model's two layers over the (virtual) stages, the encoder and
# projector with the embedding on stage 0. Megatron's VLM balancing: the embedding and the loss each count as a
# layer, 2 + 2 over 2 x 2 virtual stages = [0, 1, 1, 0] (rank 0's first chunk holds only the encoder, projector
# and embedding; rank 1's last only the final norm, output layer and loss).
PIPELINE_SPLITS = {
    "pp2": [],
    "pp2-vp2": ["model.virtual_pipeline_model_parallel_size=2", "model.account_for_embedding_in_pipeline_split=true",
                "model.account_for_loss_in_pipeline_split=true"],
}


def gemma_sft_config(hf: Path, data: Path, out: Path, layout: str | None = None):
    return vlm_sft_config(hf, data, out, ITERS, 1e-3, extra=layout_overrides(layout, PIPELINE_SPLITS))


@pytest.fixture(scope="module")
def gemma_one_process_run(gemma_run_inputs, tmp_path_factory):
    hf, data = gemma_run_inputs
    cfg = gemma_sft_config(hf, data, tmp_path_factory.mktemp("gemma-one"))
    finetune_case(cfg)
    return cfg


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "tp2_sp", "cp2", *PIPELINE_SPLITS])
def test_gemma_vlm_layouts_with_text_only_microbatches_log_the_losses_of_one_process(
        gemma_run_inputs, gemma_one_process_run, tmp_path, pool2, layout):
    """tp2_sp and cp2: the image embeddings are put into the whole sequence, which the language model then cuts
    along the sequence (sp: before the first layer; cp: its load-balanced chunks, each image's tokens still
    seeing the later tokens of their image across chunks, in the sliding-window layer too)."""
    hf, data = gemma_run_inputs
    cfg = gemma_sft_config(hf, data, tmp_path / layout, layout)
    pool2.run(finetune_case, cfg, timeout=300)
    got, want = losses_by_iteration(cfg), losses_by_iteration(gemma_one_process_run)
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    for it in want:
        assert math.isclose(got[it], want[it], rel_tol=REL), f"{layout} iteration {it}: {got[it]} vs {want[it]}"
    assert want[ITERS] < want[1]


@pytest.fixture(scope="module")
def gemma_moe_one_process_run(gemma_run_inputs, tmp_path_factory):
    hf, data = gemma_run_inputs
    cfg = moe_from_scratch(gemma_sft_config(hf, data, tmp_path_factory.mktemp("gemma-moe-one")), hf)
    assert pretrain_counting_sharded_experts(cfg) == 0
    return cfg


def test_gemma_moe_vlm_under_expert_parallel_logs_the_losses_of_one_process(
        gemma_run_inputs, gemma_moe_one_process_run, tmp_path, pool2):
    """A Gemma 3 VL whose language model (sliding-window and global layers) routes to 4 experts trains on image
    questions mixed with text-only ones; with the experts split over two ranks (EP2) its losses equal one
    process's, including the microbatches that run the encoder on a blank image."""
    hf, data = gemma_run_inputs
    cfg = moe_from_scratch(gemma_sft_config(hf, data, tmp_path / "ep2"), hf, expert_parallel=2)
    # 2 MoE layers x (fc1, gate, fc2) expert weights split by expert on each rank
    assert pool2.run(pretrain_counting_sharded_experts, cfg, timeout=300) == [6, 6]
    got, want = losses_by_iteration(cfg), losses_by_iteration(gemma_moe_one_process_run)
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    for it in want:
        assert math.isclose(got[it], want[it], rel_tol=REL), f"EP2 iteration {it}: {got[it]} vs {want[it]}"
    assert want[ITERS] < want[1]


def test_gemma_masks_are_the_assistant_tokens_and_token_type_ids_pad_with_the_tokens(gemma_run_inputs):
    """On Gemma 3's processor the loss masks equal transformers' assistant mask (the image's soft tokens never
    trained); a collated microbatch pads ``token_type_ids`` with the tokens (1 exactly at the soft tokens) and
    holds one ``pixel_values`` image per image sample, in sample order."""
    import json

    import numpy as np
    import torch

    from longspan.data.sft.dataset import EpochSampleMap
    from longspan.data.sft.formatting import SFTFormatOptions
    from longspan.data.sft.multimodal import build_multimodal_jsonl_split, load_processor

    hf, data = gemma_run_inputs
    processor = load_processor(str(hf))
    train = build_multimodal_jsonl_split(str(data / "training.jsonl"), processor, SFTFormatOptions(), 32,
                                         lambda n: EpochSampleMap(n, n, 0, False), processor.tokenizer.pad_token_id)
    soft = processor.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    rows = [json.loads(line) for line in (data / "training.jsonl").read_text().splitlines()]
    for doc, row in zip(train.docs, rows):
        messages = [{**m, "content": [{**p, "image": str(data / p["image"])} if p["type"] == "image" else p
                                      for p in m["content"]]} for m in row["messages"]]
        want = processor.apply_chat_template(messages, chat_template=gemma_chat_template(marked=True), tokenize=True,
                                             return_dict=True, return_assistant_tokens_mask=True)
        np.testing.assert_array_equal(doc.ids, np.asarray(want["input_ids"][0]))
        np.testing.assert_array_equal(doc.in_loss, np.asarray(want["assistant_masks"][0]))
        assert not doc.cut and doc.in_loss.sum() > 0 and not doc.in_loss[doc.ids == soft].any()
    samples = [train[i] for i in range(4)]
    batch = train.collate_fn(samples)
    assert batch["token_type_ids"].shape == batch["tokens"].shape
    assert torch.equal(batch["token_type_ids"], (batch["tokens"] == soft).long())
    with_images = [train.docs[train.samples[i]] for i in range(4) if train.docs[train.samples[i]].images]
    assert 0 < len(with_images) < 4 and batch["pixel_values"].shape[0] == len(with_images)
    pixels = processor.image_processor([_rgb(doc.images[0]) for doc in with_images], return_tensors="pt")
    assert torch.equal(batch["pixel_values"], pixels["pixel_values"])


def _rgb(path):
    from PIL import Image

    return Image.open(path).convert("RGB")


def test_gemma_lora_from_the_cli_learns_and_its_merged_export_scores_and_answers_alike(gemma_run_inputs, tmp_path):
    """``finetune --recipe vlm-lora`` from a Gemma 3 VL HF directory lowers the validation loss (mixed image and
    text-only data); the merged export loads in transformers, scores the validation set as longspan did, and
    its greedy answer to an image question equals ``longspan generate --image`` from the checkpoint."""
    hf, data = gemma_run_inputs
    out, export = tmp_path / "run", tmp_path / "export"
    before = hf_validation_loss(_hf_model(hf), hf, data, gemma_sample_inputs)
    run_cli(lora_cli_args(hf, data, out, iters=16, lr=1e-2), tmp_path)
    valid = validation_losses(out)
    assert len(valid) == 2 and valid[1] < valid[0] < before and valid[1] < before - 0.2, (before, valid)

    run_cli(["convert", "export", "--checkpoint", str(out), "--output", str(export)], tmp_path)
    merged = hf_validation_loss(_hf_model(export), export, data, gemma_sample_inputs)  # the adapters merged
    assert math.isclose(merged, valid[1], rel_tol=1e-4), (merged, valid[1])
    _answers_alike(out, export, data, tmp_path)


def _hf_model(directory: Path):
    import transformers

    return transformers.Gemma3ForConditionalGeneration.from_pretrained(str(directory), attn_implementation="eager")


def _answers_alike(checkpoint: Path, export: Path, data: Path, cwd: Path) -> None:
    """``longspan generate --image`` from the finetuned checkpoint (base + adapters, the processor found beside
    it) and transformers' greedy generate of the merged export give the same tokens."""
    from longspan.data.sft.multimodal import load_processor

    prompt = "<bos><start_of_image>the picture<eos>"
    ours, image = cli_image_answer(checkpoint, data, prompt, cwd)
    inputs = load_processor(str(export))(text=prompt, images=[_rgb(image)], return_tensors="pt")
    assert ours["prompt_ids"] == inputs["input_ids"][0].tolist()
    out = _hf_model(export).eval().generate(**inputs, do_sample=False, max_new_tokens=3)
    assert_answers_alike(ours, out[0, inputs["input_ids"].shape[1]:].tolist())


def test_the_recipe_placeholder_becomes_the_checkpoints_family_keeping_the_run_and_user_fields(gemma_run_inputs):
    """A VLM recipe's Qwen2.5-VL placeholder becomes the Gemma 3 VL of the HF directory: the architecture comes
    from config.json, the run's layout and length and the fields set on purpose stay; a user's shape that the
    weights contradict is a one-line error."""
    from longspan.core.errors import ConfigError
    from longspan.recipes.loading import load_config
    from longspan.training.checkpointing.hf_weights import apply_hf_model_config

    hf, _ = gemma_run_inputs
    cfg = load_config("vlm-sft", overrides=["model.freeze_vision_model=true", "model.seq_length=24",
                                            "model.tensor_model_parallel_size=2"])
    apply_hf_model_config(cfg, hf)
    model = cfg.model
    assert type(model).__name__ == "Gemma3VLModelProvider" and model.mm_tokens_per_image == 4
    assert (model.freeze_vision_model, model.seq_length, model.tensor_model_parallel_size) == (True, 24, 2)
    assert model.vision_config["hidden_size"] == 16 and model.hidden_size == 32
    cfg = load_config("vlm-sft", overrides=["model.hidden_size=64"])
    with pytest.raises(ConfigError, match=r"^model.hidden_size=64 \(set by you.*contradicts config.json "
                                          r"hidden_size=32") as info:
        apply_hf_model_config(cfg, hf)
    assert "\n" not in str(info.value)
