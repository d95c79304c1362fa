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


def gemma_sft_config(hf: Path, data: Path, out: Path, tp: int = 1, fsdp: bool = False, pp: int = 1,
                     split: tuple[str, ...] = (), sp: bool = False, cp: int = 1):
    from longspan.recipes.loading import load_config

    return load_config("vlm-sft", overrides=[
        f"checkpoint.pretrained_checkpoint={hf}", f"dataset.dataset_root={data}", "checkpoint.save=null",
        "checkpoint.load=null", f"logger.tensorboard_dir={out}/tb", "logger.log_interval=1", "model.seq_length=32",
        f"train.train_iters={ITERS}", "train.eval_iters=0", "train.global_batch_size=4", "train.micro_batch_size=2",
        "optimizer.lr=1e-3", "scheduler.lr_warmup_iters=0", "dist.distributed_backend=gloo",
        "dist.distributed_timeout_minutes=1", f"model.tensor_model_parallel_size={tp}", f"dist.use_torch_fsdp2={fsdp}",
        f"model.pipeline_model_parallel_size={pp}", *split, f"model.sequence_parallel={sp}",
        f"model.context_parallel_size={cp}",
    ])


def _finetune_case(cfg) -> int:
    from longspan.training.finetune import finetune

    finetune(cfg)
    return 0


@pytest.fixture(scope="module")
def gemma_one_process_run(gemma_run_inputs, tmp_path_factory):
    hf, data = gemma_run_inputs
    cfg = gemma_sft_config(hf, data, tmp_path_factory.mktemp("gemma-one"))
    _finetune_case(cfg)
    return cfg


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "tp2_sp", "cp2", *PIPELINE_SPLITS])
def test_gemma_vlm_layouts_with_text_only_microbatches_log_the_losses_of_one_process(
        gemma_run_inputs, gemma_one_process_run, tmp_path, pool2, layout):
    """tp2_sp and cp2: the image embeddings are put into the whole sequence, which the language model then cuts
    along the sequence (sp: before the first layer; cp: its load-balanced chunks, each image's tokens still
    seeing the later tokens of their image across chunks, in the sliding-window layer too)."""
    hf, data = gemma_run_inputs
    cfg = gemma_sft_config(hf, data, tmp_path / layout, tp=2 if layout.startswith("tp2") else 1,
                           fsdp=layout == "fsdp2", pp=2 if layout in PIPELINE_SPLITS else 1,
                           split=tuple(PIPELINE_SPLITS.get(layout, ())), sp=layout == "tp2_sp",
                           cp=2 if layout == "cp2" else 1)
    pool2.run(_finetune_case, cfg, timeout=300)
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


def _hf_validation_loss(model_dir: Path, data: Path) -> float:
    """Σ loss / Σ loss tokens of transformers' Gemma 3 VL over validation.jsonl (longspan's samples and masks)."""
    import torch
    import transformers

    from longspan.data.sft.dataset import EpochSampleMap
    from longspan.data.sft.formatting import SFTFormatOptions
    from longspan.data.sft.multimodal import build_multimodal_jsonl_split, load_processor

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), attn_implementation="eager")
    processor = load_processor(str(model_dir))
    samples = build_multimodal_jsonl_split(str(data / "validation.jsonl"), processor, SFTFormatOptions(), 32,
                                           lambda n: EpochSampleMap(n, n, 0, False), 0)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for i in range(len(samples)):
            s = samples[i]
            images = {k: s[k][None] if k == "token_type_ids" else s[k] for k in ("pixel_values", "token_type_ids")
                      if k in s}
            logits = model.eval()(input_ids=s["tokens"][None], **images).logits[0]
            losses = torch.nn.functional.cross_entropy(logits.float(), s["labels"], reduction="none")
            total += float((losses * s["loss_mask"]).sum())
            count += float(s["loss_mask"].sum())
    return total / count


def test_gemma_lora_from_the_cli_learns_and_its_merged_export_scores_and_answers_alike(gemma_run_inputs, tmp_path):
    """``finetune --recipe vlm-lora`` from a Gemma 3 VL HF directory lowers the validation loss (mixed image and
    text-only data); the merged export loads in transformers, scores the validation set as longspan did, and
    its greedy answer to an image question equals ``longspan generate --image`` from the checkpoint."""
    import json

    from tests.test_finetune_e2e import _run_here

    hf, data = gemma_run_inputs
    out, export = tmp_path / "run", tmp_path / "export"
    before = _hf_validation_loss(hf, data)
    _run_here(["finetune", "--recipe", "vlm-lora", f"checkpoint.pretrained_checkpoint={hf}",
               f"dataset.dataset_root={data}", f"checkpoint.save={out}", f"checkpoint.load={out}",
               f"logger.tensorboard_dir={out}/tb", "model.seq_length=32", "train.train_iters=16",
               "train.eval_interval=8", "train.eval_iters=2", "train.global_batch_size=4", "train.micro_batch_size=2",
               "optimizer.lr=1e-2", "scheduler.lr_warmup_iters=2", "peft.dim=8", "peft.alpha=16",
               "checkpoint.save_interval=16"], cwd=tmp_path)
    records = [json.loads(x) for x in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["losses"]["lm loss"] for r in records if r.get("phase") == "validation"]
    assert len(valid) == 2 and valid[1] < valid[0] < before and valid[1] < before - 0.2, (before, valid)

    _run_here(["convert", "export", "--checkpoint", str(out), "--output", str(export)], cwd=tmp_path)
    merged = _hf_validation_loss(export, data)  # the adapters merged into the weights
    assert math.isclose(merged, valid[1], rel_tol=1e-4), (merged, valid[1])
    _answers_alike(out, export, data, tmp_path)


def _answers_alike(checkpoint: Path, export: Path, data: Path, cwd: Path) -> None:
    """``longspan generate --image`` from the finetuned checkpoint (base + adapters, the processor found beside
    it) and transformers' greedy generate of the merged export give the same tokens."""
    import json

    import torch
    import transformers

    from longspan.data.sft.multimodal import load_processor
    from tests.test_finetune_e2e import _run_here

    rows = [json.loads(line) for line in (data / "validation.jsonl").read_text().splitlines()]
    image = data / next(r for r in rows if r["messages"][0]["content"][0]["type"] == "image")["messages"][0][
        "content"][0]["image"]
    prompt = "<bos><start_of_image>the picture<eos>"
    printed = _run_here(["generate", "--checkpoint", str(checkpoint), "--image", str(image), "--prompt", prompt,
                         "--max-new-tokens", "3", "--json"], cwd=cwd)
    ours = json.loads(printed.strip().splitlines()[-1])
    inputs = load_processor(str(export))(text=prompt, images=[_rgb(image)], return_tensors="pt")
    assert ours["prompt_ids"] == inputs["input_ids"][0].tolist()
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(export), attn_implementation="eager")
    out = model.eval().generate(**inputs, do_sample=False, max_new_tokens=3)
    assert ours["output_ids"] and ours["output_ids"] == out[0, inputs["input_ids"].shape[1]:].tolist()[
        : len(ours["output_ids"])]


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
