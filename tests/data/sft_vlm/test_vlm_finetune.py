"""Finetuning a tiny random Qwen2.5-VL (four decoder layers) on drawn squares ('what colour' -> the colour)
through the trainer: FSDP2, tensor (and sequence) parallel, context parallel and pipeline parallel over two ranks
log the losses of one process (fp32, rel <= 1e-5, every one of 8 iterations; the vision encoder replicated under
TP, on the stage holding the embedding under PP: even, uneven and interleaved with virtual stages; a language
model with experts under EP2, resumed halfway from its checkpoint), and a LoRA finetune
from the command line lowers the validation loss and exports a merged HF model that transformers loads, that
scores the validation set as longspan did and answers an image question as ``longspan generate`` does."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.data.sft_vlm.conftest import (moe_from_scratch, pretrain_counting_sharded_experts, qwen_colour_rows,
                                         write_jsonl)
from tests.helpers.vlm import (finetune_case, layout_overrides, qwen_vl_lora_learns_and_exports_alike,
                               vlm_sft_config)
from tests.training.pretrain_helpers import losses_by_iteration

ITERS = 8
REL = 1e-5  # fp32 CPU layout parity


@pytest.fixture(scope="module")
def vl_run_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Qwen2.5-VL HF directory and a data directory of colour questions (all with an image). Four
    decoder layers: the uneven and virtual pipeline splits below put different layer counts on the stages."""
    from tests.models.vlm.qwen_vl_fixtures import make_qwen_vl

    root = tmp_path_factory.mktemp("vlm-run")
    hf, data = root / "hf", root / "data"
    hf.mkdir()
    make_qwen_vl(hf, text_layers=4)
    rows = qwen_colour_rows(str(data), 24, seed=1)
    write_jsonl(str(data / "training.jsonl"), rows[:16])
    write_jsonl(str(data / "validation.jsonl"), rows[16:])
    return hf, data


# The pipeline splits of the PP layouts: the language model's four layers over the (virtual) stages, the vision
# encoder and merger always with the embedding on stage 0 (rank 0's first chunk).
PIPELINE_SPLITS = {
    "pp2": [],  # layers [2, 2]
    "pp2-uneven": ["model.num_layers_in_first_pipeline_stage=1"],  # [1, 3]: the encoder's stage is lightened
    "pp2-vp2": ["model.virtual_pipeline_model_parallel_size=2"],  # [1, 1, 1, 1], interleaved 1F1B
}


def _sft_config(hf: Path, data: Path, out: Path, layout: str | None = None, save: bool = False):
    # lr 3e-4: at 1e-3 Adam grows the layouts' last-bit gradient differences into loss differences near 1e-5 by
    # iteration 6 of the four-layer model (tp2_sp measured 1.05e-5); at 3e-4 every layout stays within 1.1e-6.
    return vlm_sft_config(hf, data, out, ITERS, 3e-4, extra=[
        f"checkpoint.save={out / 'ckpt' if save else 'null'}", f"checkpoint.save_interval={ITERS}",
        *layout_overrides(layout, PIPELINE_SPLITS)])


@pytest.fixture(scope="module")
def one_process_run(vl_run_inputs, tmp_path_factory):
    hf, data = vl_run_inputs
    cfg = _sft_config(hf, data, tmp_path_factory.mktemp("one"), save=True)
    finetune_case(cfg)
    return cfg


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "tp2_sp", "cp2", *PIPELINE_SPLITS])
def test_vlm_finetune_layouts_log_the_losses_of_one_process(vl_run_inputs, one_process_run, tmp_path, pool2, layout):
    """tp2_sp and cp2: the image embeddings are put into the whole sequence and its mRoPE positions numbered, then
    the language model cuts it along the sequence (sp: before the first layer; cp: its load-balanced chunks)."""
    hf, data = vl_run_inputs
    cfg = _sft_config(hf, data, tmp_path / layout, layout, save=layout == "pp2-uneven")
    pool2.run(finetune_case, cfg, timeout=300)
    got, want = losses_by_iteration(cfg), losses_by_iteration(one_process_run)
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    rel = {it: abs(got[it] - want[it]) / abs(want[it]) for it in want}
    for it in want:
        assert math.isclose(got[it], want[it], rel_tol=REL), f"{layout} iteration {it}: {got[it]} vs {want[it]} ({rel})"
    assert want[ITERS] < want[1]
    if cfg.checkpoint.save:
        _loads_in_one_process_as_the_one_process_run(cfg.checkpoint.save, one_process_run.checkpoint.save)


def _loads_in_one_process_as_the_one_process_run(saved: str, reference: str) -> None:
    """The uneven pipeline run's checkpoint (encoder and one layer on rank 0, three layers on rank 1) loads into
    one process, every parameter under its name, with the weights the one-process run trained (to Adam's
    amplification of rounding, far below the weights' differences between parameters or training steps)."""
    import torch

    from longspan.training.checkpointing.model_loading import load_model_from_checkpoint

    got = dict(load_model_from_checkpoint(saved, device="cpu").model[0].named_parameters())
    want = dict(load_model_from_checkpoint(reference, device="cpu").model[0].named_parameters())
    assert sorted(got) == sorted(want) and any(name.startswith("vision.") for name in got)
    for name, param in want.items():
        # Adam's steps (lr 1e-3) turn the layouts' last-bit gradient differences into weight differences of a few
        # 1e-6 where a gradient is near zero; a weight under another name is off by ~0.1, eight untrained steps
        # by ~1e-3
        torch.testing.assert_close(got[name], param, rtol=0, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def moe_one_process_run(vl_run_inputs, tmp_path_factory):
    hf, data = vl_run_inputs
    cfg = moe_from_scratch(_sft_config(hf, data, tmp_path_factory.mktemp("moe-one")), hf)
    assert pretrain_counting_sharded_experts(cfg) == 0
    return cfg


def test_moe_vlm_under_expert_parallel_logs_the_losses_of_one_process(vl_run_inputs, moe_one_process_run, tmp_path,
                                                                      pool2):
    """A Qwen2.5-VL whose language model routes to 4 experts trains on image questions; with the experts split
    over two ranks (EP2: all-to-all dispatch, the encoder replicated), stopped at iteration 4 and resumed from
    its checkpoint (expert shards saved and loaded), its losses equal one process's."""
    hf, data = vl_run_inputs
    checkpoints = str(tmp_path / "checkpoints")
    runs = []
    for name, stop in (("ep2", ITERS // 2), ("ep2-resumed", None)):
        cfg = moe_from_scratch(_sft_config(hf, data, tmp_path / name), hf, expert_parallel=2)
        cfg.checkpoint.save = cfg.checkpoint.load = checkpoints
        cfg.checkpoint.save_interval, cfg.train.exit_interval = ITERS // 2, stop
        # every MoE layer's (fc1, gate, fc2) expert weights split by expert on each rank
        want_sharded = 3 * cfg.model.num_layers
        assert pool2.run(pretrain_counting_sharded_experts, cfg, timeout=300) == [want_sharded] * 2
        runs.append(losses_by_iteration(cfg))
    half = ITERS // 2
    assert sorted(runs[0]) == list(range(1, half + 1)) and sorted(runs[1]) == list(range(half + 1, ITERS + 1))
    got, want = {**runs[0], **runs[1]}, losses_by_iteration(moe_one_process_run)
    for it in want:
        assert math.isclose(got[it], want[it], rel_tol=REL), f"EP2 iteration {it}: {got[it]} vs {want[it]}"
    assert want[ITERS] < want[1]


def test_expert_parallel_on_a_dense_vlm_is_a_one_line_config_error():
    """Both vision-language providers read GPT's expert-parallel rows: EP2 without experts is GPT's ConfigError."""
    from longspan.core.errors import ConfigError
    from longspan.models.vlm import Gemma3VLModelProvider
    from longspan.recipes.loading import load_config

    cfg = load_config("vlm-sft", overrides=["model.expert_model_parallel_size=2"])
    gemma = Gemma3VLModelProvider(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128,
        seq_length=cfg.model.seq_length, mm_tokens_per_image=4, expert_model_parallel_size=2,
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "num_channels": 3, "image_size": 28, "patch_size": 14})
    for model in (cfg.model, gemma):
        cfg.model = model
        with pytest.raises(ConfigError, match="model.expert_model_parallel_size=2 needs model.num_moe_experts") as info:
            cfg.validate(world_size=2)
        assert "\n" not in str(info.value)


def test_lora_finetune_from_the_cli_learns_and_its_merged_export_scores_and_answers_alike(vl_run_inputs, tmp_path):
    import transformers

    hf, data = vl_run_inputs
    qwen_vl_lora_learns_and_exports_alike(transformers.Qwen2_5_VLForConditionalGeneration, hf, data, tmp_path, iters=24)
