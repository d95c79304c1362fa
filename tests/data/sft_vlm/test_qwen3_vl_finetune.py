"""Finetuning a tiny random Qwen3-VL through the VLM recipes on drawn squares mixed with conversations without an
image: the recipe's placeholder becomes the checkpoint's Qwen3-VL, a LoRA finetune from the command line lowers
the validation loss, and its merged export loads in transformers, scores the validation set as longspan did and
answers an image question as ``longspan generate --image`` does from the checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.data.sft_vlm.conftest import colour_rows, write_jsonl


@pytest.fixture(scope="module")
def qwen3_vl_run_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Qwen3-VL HF directory and colour questions, half of them (in pairs) without an image."""
    from tests.models.vlm.qwen3_vl_fixtures import make_qwen3_vl

    root = tmp_path_factory.mktemp("qwen3-vl-run")
    hf, data = root / "hf", root / "data"
    hf.mkdir()
    make_qwen3_vl(hf)
    rows = colour_rows(str(data), 24, seed=1)
    for i, row in enumerate(rows):  # words of the fixture tokenizer's vocabulary
        row["messages"][0]["content"][1]["text"] = "what colour"
        row["messages"][2:] = []
        if i % 4 >= 2:  # consecutive pairs: some microbatches hold no image
            row["messages"][0]["content"] = [{"type": "text", "text": "what colour"}]
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


def _hf_validation_loss(model_dir: Path, data: Path) -> float:
    """Σ loss / Σ loss tokens of transformers' Qwen3-VL over validation.jsonl (longspan's samples and masks)."""
    import torch
    import transformers

    from longspan.data.sft.dataset import EpochSampleMap
    from longspan.data.sft.formatting import SFTFormatOptions
    from longspan.data.sft.multimodal import build_multimodal_jsonl_split, load_processor

    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(model_dir)).eval()
    samples = build_multimodal_jsonl_split(str(data / "validation.jsonl"), load_processor(str(model_dir)),
                                           SFTFormatOptions(), 32, lambda n: EpochSampleMap(n, n, 0, False), 0)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for i in range(len(samples)):
            s = samples[i]
            ids = s["tokens"][None]
            images = {k: s[k] for k in ("pixel_values", "image_grid_thw") if k in s}
            logits = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                           **images).logits[0]
            losses = torch.nn.functional.cross_entropy(logits.float(), s["labels"], reduction="none")
            total += float((losses * s["loss_mask"]).sum())
            count += float(s["loss_mask"].sum())
    return total / count


def test_lora_finetune_from_the_cli_learns_and_its_merged_export_scores_and_answers_alike(qwen3_vl_run_inputs,
                                                                                          tmp_path):
    from tests.test_finetune_e2e import _run_here

    hf, data = qwen3_vl_run_inputs
    out, export = tmp_path / "run", tmp_path / "export"
    before = _hf_validation_loss(hf, data)
    _run_here(["finetune", "--recipe", "vlm-lora", f"checkpoint.pretrained_checkpoint={hf}",
               f"dataset.dataset_root={data}", f"checkpoint.save={out}", f"checkpoint.load={out}",
               f"logger.tensorboard_dir={out}/tb", "model.seq_length=32", "train.train_iters=16",
               "train.eval_interval=8", "train.eval_iters=2", "train.global_batch_size=4", "train.micro_batch_size=2",
               "optimizer.lr=5e-3", "scheduler.lr_warmup_iters=2", "peft.dim=8", "peft.alpha=16",
               "checkpoint.save_interval=16"], cwd=tmp_path)
    records = [json.loads(x) for x in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["losses"]["lm loss"] for r in records if r.get("phase") == "validation"]
    assert len(valid) == 2 and valid[1] < valid[0] < before and valid[1] < 0.5 * before, (before, valid)

    _run_here(["convert", "export", "--checkpoint", str(out), "--output", str(export)], cwd=tmp_path)
    assert (export / "preprocessor_config.json").is_file()
    merged = _hf_validation_loss(export, data)  # the adapters merged into the weights
    assert math.isclose(merged, valid[1], rel_tol=1e-4), (merged, valid[1])
    _answers_alike(out, export, data, tmp_path)


def _answers_alike(checkpoint: Path, export: Path, data: Path, cwd: Path) -> None:
    """``longspan generate --image`` from the finetuned checkpoint (base + adapters) and transformers' greedy
    generate of the merged export give the same answer to a validation question."""
    import torch
    import transformers
    from PIL import Image

    from longspan.data.sft.multimodal import load_processor
    from tests.test_finetune_e2e import _run_here

    row = json.loads((data / "validation.jsonl").read_text().splitlines()[0])
    image = data / row["messages"][0]["content"][0]["image"]
    prompt = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what colour<|im_end|>\n"
              "<|im_start|>assistant\n")
    printed = _run_here(["generate", "--checkpoint", str(checkpoint), "--image", str(image), "--prompt", prompt,
                         "--max-new-tokens", "3", "--json"], cwd=cwd)
    ours = json.loads(printed.strip().splitlines()[-1])
    pixels = load_processor(str(export)).image_processor(images=[Image.open(image).convert("RGB")],
                                                        return_tensors="pt")
    ids = torch.tensor([ours["prompt_ids"]])
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(export)).eval()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         mm_token_type_ids=(ids == model.config.image_token_id).int(), do_sample=False,
                         max_new_tokens=3, **pixels)
    assert ours["output_ids"] and ours["output_ids"] == out[0, ids.shape[1]:].tolist()[: len(ours["output_ids"])]


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
    from longspan.recipes.loading import load_config

    return load_config("vlm-sft", overrides=[
        f"checkpoint.pretrained_checkpoint={hf}", f"dataset.dataset_root={data}", "checkpoint.save=null",
        "checkpoint.load=null", f"logger.tensorboard_dir={out}/tb", "logger.log_interval=1", "model.seq_length=32",
        f"train.train_iters={LAYOUT_ITERS}", "train.eval_iters=0", "train.global_batch_size=4",
        "train.micro_batch_size=2", "optimizer.lr=3e-4", "scheduler.lr_warmup_iters=0",
        "dist.distributed_backend=gloo", "dist.distributed_timeout_minutes=1", *layout,
    ])


def _finetune_case(cfg) -> int:
    from longspan.training.finetune import finetune

    finetune(cfg)
    return 0


@pytest.mark.slow
def test_qwen3_vl_layouts_with_text_only_microbatches_log_the_losses_of_one_process(qwen3_vl_run_inputs, tmp_path,
                                                                                   pool2):
    """Every rank's microbatches mix image questions and text-only ones (those run the encoder and mergers on a
    blank image times 0); DeepStack's features reach the first two layers in every layout."""
    from tests.training.pretrain_helpers import losses_by_iteration

    hf, data = qwen3_vl_run_inputs
    reference = _sft_config(hf, data, tmp_path / "one")
    _finetune_case(reference)
    want = losses_by_iteration(reference)
    assert sorted(want) == list(range(1, LAYOUT_ITERS + 1)) and want[LAYOUT_ITERS] < want[1]
    for layout, overrides in LAYOUTS.items():
        cfg = _sft_config(hf, data, tmp_path / layout, tuple(overrides))
        pool2.run(_finetune_case, cfg, timeout=300)
        got = losses_by_iteration(cfg)
        assert sorted(got) == sorted(want)
        for it in want:
            assert math.isclose(got[it], want[it], rel_tol=REL), f"{layout} iteration {it}: {got[it]} vs {want[it]}"
