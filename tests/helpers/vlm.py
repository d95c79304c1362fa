"""Helpers shared by the vision-language tests (tests/models/vlm, tests/conversion, tests/data/sft_vlm): export
checks, transformers' greedy continuation, transformers' validation loss over longspan's samples, the VLM SFT
run's overrides and the CLI LoRA run with its ``generate --image`` answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from longspan import AutoBridge
from longspan.conversion import families
from tests.conversion.parity import tensors


def assert_export_bit_identical(source: Path, exported: Path, files: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Every tensor of ``source`` is in ``exported`` (no more) with its dtype and bits, and each of ``files`` has
    the same bytes; returns the source's tensors."""
    original, written = tensors(source), tensors(exported)
    assert sorted(original) == sorted(written)
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    for name in files:
        assert (Path(exported) / name).read_bytes() == (Path(source) / name).read_bytes(), name
    return original


def assert_same_config_json(source: Path, exported: Path) -> None:
    """The two config.json files are equal but for the transformers version that wrote them."""
    source_cfg, exported_cfg = (json.loads((Path(d) / "config.json").read_text()) for d in (source, exported))
    exported_cfg.pop("transformers_version", None), source_cfg.pop("transformers_version", None)
    assert exported_cfg == source_cfg


def assert_provider_export_reads_back(bridge: Any, model: Any, hf: Any, inputs: dict[str, torch.Tensor],
                                      out: Path, model_class: Any, atol: float) -> None:
    """A model built in longspan exports as ``model_class`` from its provider alone (no source config.json), and
    transformers' model read back from that export gives ``hf``'s logits on ``inputs`` (eager attention)."""
    provider = bridge.to_megatron_provider()
    assert families.family_for_provider(provider).architecture == model_class.__name__
    AutoBridge.from_longspan_provider(provider).save_hf_pretrained([model], out)
    reloaded = model_class.from_pretrained(str(out), attn_implementation="eager")
    with torch.no_grad():
        assert (reloaded.eval()(**inputs).logits - hf(**inputs).logits).abs().max().item() <= atol


def hf_greedy_ids(hf: Any, inputs: dict[str, torch.Tensor], new_tokens: int) -> list[int]:
    """Transformers' greedy continuation of exactly ``new_tokens`` tokens (no end-of-sequence stop); an all-ones
    attention mask unless ``inputs`` hold one."""
    prompt = inputs["input_ids"]
    out = hf.generate(**{"attention_mask": torch.ones_like(prompt), **inputs}, do_sample=False,
                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def qwen_vl_sample_inputs(sample: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """A Qwen-VL transformers model's inputs for one longspan SFT sample (it finds the image tokens for mRoPE
    through ``mm_token_type_ids``)."""
    ids = sample["tokens"][None]
    images = {k: sample[k] for k in ("pixel_values", "image_grid_thw") if k in sample}
    return {"input_ids": ids, "mm_token_type_ids": (ids == model.config.image_token_id).int(), **images}


def gemma_sample_inputs(sample: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """A Gemma 3 VL transformers model's inputs for one longspan SFT sample."""
    images = {k: sample[k][None] if k == "token_type_ids" else sample[k] for k in ("pixel_values", "token_type_ids")
              if k in sample}
    return {"input_ids": sample["tokens"][None], **images}


def hf_validation_loss(model: Any, model_dir: Path, data: Path,
                       sample_inputs: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]) -> float:
    """Σ loss / Σ loss tokens of the transformers ``model`` over ``data``/validation.jsonl (longspan's samples and
    masks, built with ``model_dir``'s processor, 32 tokens)."""
    from longspan.data.sft.dataset import EpochSampleMap
    from longspan.data.sft.formatting import SFTFormatOptions
    from longspan.data.sft.multimodal import build_multimodal_jsonl_split, load_processor

    model = model.eval()
    samples = build_multimodal_jsonl_split(str(data / "validation.jsonl"), load_processor(str(model_dir)),
                                           SFTFormatOptions(), 32, lambda n: EpochSampleMap(n, n, 0, False), 0)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for i in range(len(samples)):
            s = samples[i]
            logits = model(**sample_inputs(s, model)).logits[0]
            losses = torch.nn.functional.cross_entropy(logits.float(), s["labels"], reduction="none")
            total += float((losses * s["loss_mask"]).sum())
            count += float(s["loss_mask"].sum())
    return total / count


def vlm_sft_config(hf: Path, data: Path, out: Path, iters: int, lr: float, seq_length: int = 32,
                   extra: Sequence[str] = ()) -> Any:
    """The ``vlm-sft`` recipe on ``hf`` and ``data`` for a layout-parity run: no checkpoints, losses logged every
    iteration under ``out``/tb, no evaluation, 2 microbatches of 2, gloo; ``extra`` overrides after these."""
    from longspan.recipes.loading import load_config

    return load_config("vlm-sft", overrides=[
        f"checkpoint.pretrained_checkpoint={hf}", f"dataset.dataset_root={data}", "checkpoint.save=null",
        "checkpoint.load=null", f"logger.tensorboard_dir={out}/tb", "logger.log_interval=1",
        f"model.seq_length={seq_length}", f"train.train_iters={iters}", "train.eval_iters=0",
        "train.global_batch_size=4", "train.micro_batch_size=2", f"optimizer.lr={lr}", "scheduler.lr_warmup_iters=0",
        "dist.distributed_backend=gloo", "dist.distributed_timeout_minutes=1", *extra,
    ])


def layout_overrides(layout: str | None, pipeline_splits: dict[str, list[str]]) -> list[str]:
    """The overrides of a named two-rank layout (fsdp2, tp2, tp2_sp, cp2 or a key of ``pipeline_splits``, each
    split's extra overrides after PP2); ``None``: one process, every parallel size spelled as 1."""
    name = layout or ""
    return [f"model.tensor_model_parallel_size={2 if name.startswith('tp2') else 1}",
            f"dist.use_torch_fsdp2={name == 'fsdp2'}",
            f"model.pipeline_model_parallel_size={2 if name in pipeline_splits else 1}",
            *pipeline_splits.get(name, ()), f"model.sequence_parallel={name == 'tp2_sp'}",
            f"model.context_parallel_size={2 if name == 'cp2' else 1}"]


def finetune_each(cfgs: list[Any]) -> int:
    """``finetune`` each config in turn (a shared-pool case: several layouts in one call)."""
    from longspan.training.finetune import finetune

    for cfg in cfgs:
        finetune(cfg)
    return 0


def finetune_case(cfg: Any) -> int:
    """``finetune(cfg)`` (a shared-pool case)."""
    return finetune_each([cfg])


def lora_cli_args(hf: Path, data: Path, out: Path, iters: int, lr: float, seq_length: int = 32) -> list[str]:
    """``finetune --recipe vlm-lora`` on ``hf`` and ``data``: ``iters`` steps, two evaluations, one checkpoint at
    the end under ``out``."""
    return ["finetune", "--recipe", "vlm-lora", f"checkpoint.pretrained_checkpoint={hf}",
            f"dataset.dataset_root={data}", f"checkpoint.save={out}", f"checkpoint.load={out}",
            f"logger.tensorboard_dir={out}/tb", f"model.seq_length={seq_length}", f"train.train_iters={iters}",
            f"train.eval_interval={iters // 2}", "train.eval_iters=2", "train.global_batch_size=4",
            "train.micro_batch_size=2", f"optimizer.lr={lr}", "scheduler.lr_warmup_iters=2", "peft.dim=8",
            "peft.alpha=16", f"checkpoint.save_interval={iters}"]


def validation_losses(out: Path) -> list[float]:
    """The validation ``lm loss`` values a run logged under ``out``/tb, in order."""
    records = [json.loads(x) for x in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    return [r["losses"]["lm loss"] for r in records if r.get("phase") == "validation"]


def run_cli(args: list[str], cwd: Path) -> str:
    """``longspan <args>`` in a fresh process; returns what it printed."""
    # function-level: tests/test_finetune_e2e.py is a test module, imported only by the tests that run the CLI
    from tests.test_finetune_e2e import _run_here

    return _run_here(args, cwd=cwd)


def cli_image_answer(checkpoint: Path, data: Path, prompt: str, cwd: Path) -> tuple[dict[str, Any], Path]:
    """``longspan generate --checkpoint --image --json`` (3 new tokens) on the first validation question with an
    image; returns (its JSON, the image's path)."""
    rows = [json.loads(line) for line in (data / "validation.jsonl").read_text().splitlines()]
    image = data / next(r for r in rows if r["messages"][0]["content"][0]["type"] == "image")["messages"][0][
        "content"][0]["image"]
    printed = run_cli(["generate", "--checkpoint", str(checkpoint), "--image", str(image), "--prompt", prompt,
                       "--max-new-tokens", "3", "--json"], cwd)
    return json.loads(printed.strip().splitlines()[-1]), image


def assert_answers_alike(ours: dict[str, Any], theirs: list[int]) -> None:
    """longspan's answer is non-empty and transformers' answer starts with it."""
    assert ours["output_ids"] and ours["output_ids"] == theirs[: len(ours["output_ids"])]


QWEN_VL_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what colour<|im_end|>\n"
                  "<|im_start|>assistant\n")


def qwen_vl_answers_alike(model_class: Any, checkpoint: Path, export: Path, data: Path, cwd: Path) -> None:
    """``longspan generate --image`` from the finetuned checkpoint (base + adapters) and transformers' greedy
    generate of the merged export (a Qwen-VL ``model_class``) give the same answer to a validation question."""
    from longspan.data.sft.multimodal import load_processor, open_image

    ours, image = cli_image_answer(checkpoint, data, QWEN_VL_PROMPT, cwd)
    pixels = load_processor(str(export)).image_processor(images=[open_image(str(image), None, "test")],
                                                        return_tensors="pt")
    ids = torch.tensor([ours["prompt_ids"]])
    model = model_class.from_pretrained(str(export)).eval()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         mm_token_type_ids=(ids == model.config.image_token_id).int(), do_sample=False,
                         max_new_tokens=3, **pixels)
    assert_answers_alike(ours, out[0, ids.shape[1]:].tolist())


def qwen_vl_lora_learns_and_exports_alike(model_class: Any, hf: Path, data: Path, cwd: Path, iters: int) -> None:
    """``finetune --recipe vlm-lora`` (``iters`` steps, lr 5e-3) from the Qwen-VL directory ``hf`` lowers
    transformers' validation loss by more than half; the merged export (``model_class``) scores the validation set
    as the run's last evaluation did and answers an image question as ``longspan generate --image`` does from the
    checkpoint."""
    import math

    out, export = cwd / "run", cwd / "export"
    before = hf_validation_loss(model_class.from_pretrained(str(hf)), hf, data, qwen_vl_sample_inputs)
    run_cli(lora_cli_args(hf, data, out, iters=iters, lr=5e-3), cwd)
    valid = validation_losses(out)
    assert len(valid) == 2 and valid[1] < valid[0] < before and valid[1] < 0.5 * before, (before, valid)

    run_cli(["convert", "export", "--checkpoint", str(out), "--output", str(export)], cwd)
    assert (export / "preprocessor_config.json").is_file()
    # the adapters merged into the weights
    merged = hf_validation_loss(model_class.from_pretrained(str(export)), export, data, qwen_vl_sample_inputs)
    assert math.isclose(merged, valid[1], rel_tol=1e-4), (merged, valid[1])
    qwen_vl_answers_alike(model_class, out, export, data, cwd)
