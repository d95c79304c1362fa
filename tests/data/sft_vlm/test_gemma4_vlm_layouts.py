"""Gemma 4 with images whose image tokens attend both ways (``use_bidirectional_attention='vision'``) under pipeline
parallel (encoder and projector on the first stage; which tokens are image tokens travels in the stage carry, so
the second stage's sliding-window layer masks each image's block as one process does), tensor parallel with
sequence parallel, and context parallel (image blocks straddle the shards: each rank keeps its query rows of the
two-way mask over every key column): each logs one process's losses over 8 iterations (fp32, rel 1e-5) and its
gradient norms (see NORM_REL) on image questions mixed with text-only ones. All layouts run in one call of the
shared two-process pool. Sequence parallel with per-layer inputs is a one-line error."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.data.sft_vlm.conftest import write_jsonl
from tests.data.sft_vlm.gemma_fixtures import GEMMA4_CHAT_TEMPLATE as CHAT_TEMPLATE, gemma_colour_rows
from tests.helpers.vlm import finetune_each as _finetune_each

ITERS = 8  # the acceptance's 8 iterations
REL = 1e-5  # fp32 CPU layout parity: every iteration's loss (measured: 2e-7 at most), iteration 1's grad norm
# The grad norms of later iterations (the weights then differ by the layouts' rounding, which Adam's steps amplify)
# measured against one process: PP2 8e-6, TP2 + SP 1.7e-5, CP2 1.9e-5, and plain TP2 (proven for losses by
# test_gemma4_vlm_finetune.py) 3.1e-5 on this model; a missing or doubled reduction moves iteration 1's.
NORM_REL = 5e-5
LAYOUTS = {"pp2": ["model.pipeline_model_parallel_size=2", "model.num_layers_in_first_pipeline_stage=1"],
           "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
           "cp2": ["model.context_parallel_size=2"]}


@pytest.fixture(scope="module")
def gemma4_two_way_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Gemma 4 VL HF directory whose image tokens attend both ways, with layers sliding, sliding,
    full (a sliding-window layer on each side of the pipeline cut; the carry between the stages then holds the
    hidden states and the image-token slot only) and no per-layer inputs (sequence parallel does not split
    them), and colour questions, every second one without an image."""
    import transformers

    import tests.conversion.gemma4_vlm_models as models

    def three_layers(tokenizer: Any, **kwargs: Any) -> Any:
        config = plain_config(tokenizer, bidirectional="vision", vision_layers=1).to_dict()
        config["text_config"].pop("per_layer_config")  # the 2-layer model's (rebuilt from global_head_dim)
        config["text_config"].update(num_hidden_layers=3, hidden_size_per_layer_input=0, rms_norm_eps=1e-2,
                                     layer_types=["sliding_attention", "sliding_attention", "full_attention"])
        config["vision_config"].update(rms_norm_eps=1e-2, use_clipped_linears=False)
        return transformers.Gemma4Config.from_dict(config)

    root = tmp_path_factory.mktemp("gemma4-vlm-two-way")
    hf, data = root / "hf", root / "data"
    hf.mkdir()
    plain_config = models.gemma4_vlm_config
    with pytest.MonkeyPatch.context() as patch:  # make_gemma4_vlm's initialization on this configuration
        patch.setattr(models, "gemma4_vlm_config", three_layers)
        models.make_gemma4_vlm(hf)
    (hf / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    rows = gemma_colour_rows(str(data), 16, seed=1, text_only_every=2)
    write_jsonl(str(data / "training.jsonl"), rows)
    write_jsonl(str(data / "validation.jsonl"), rows[:2])
    return hf, data


def _config(hf: Path, data: Path, out: Path, layout: tuple[str, ...] = ()) -> Any:
    from longspan.recipes.loading import load_config

    return load_config("vlm-sft", overrides=[
        f"checkpoint.pretrained_checkpoint={hf}", f"dataset.dataset_root={data}", "checkpoint.save=null",
        "checkpoint.load=null", f"logger.tensorboard_dir={out}/tb", "logger.log_interval=1", "model.seq_length=96",
        f"train.train_iters={ITERS}", "train.eval_iters=0", "train.global_batch_size=4", "train.micro_batch_size=2",
        "optimizer.lr=1e-4", "scheduler.lr_warmup_iters=0", "dist.distributed_backend=gloo",
        "dist.distributed_timeout_minutes=1", *layout,
    ])


def _losses_and_norms(cfg: Any) -> dict[int, tuple[float, float]]:
    from tests.training.pretrain_helpers import read_metrics

    return {r["iteration"]: (r["losses"]["lm loss"], r["grad_norm"]) for r in read_metrics(cfg)}


@pytest.mark.slow
def test_gemma4_two_way_image_blocks_under_pp2_tp2_sp_and_cp2_log_the_losses_and_grad_norms_of_one_process(
        gemma4_two_way_inputs, tmp_path, pool2):
    hf, data = gemma4_two_way_inputs
    one = _config(hf, data, tmp_path / "one")
    _finetune_each([one])
    assert one.model.use_bidirectional_attention == "vision" and one.model.num_layers == 3  # the checkpoint's
    want = _losses_and_norms(one)
    assert sorted(want) == list(range(1, ITERS + 1)) and want[ITERS][0] < want[1][0]
    layouts = {name: _config(hf, data, tmp_path / name, tuple(overrides)) for name, overrides in LAYOUTS.items()}
    pool2.run(_finetune_each, list(layouts.values()), timeout=300)
    for layout, cfg in layouts.items():
        got = _losses_and_norms(cfg)
        assert sorted(got) == sorted(want), layout
        for it, (loss, norm) in want.items():
            assert math.isclose(got[it][0], loss, rel_tol=REL), f"{layout} iteration {it} loss: {got[it][0]} vs {loss}"
            norm_rel = REL if it == 1 else NORM_REL
            assert math.isclose(got[it][1], norm, rel_tol=norm_rel), (
                f"{layout} iteration {it} grad norm: {got[it][1]} vs {norm}")


def test_sequence_parallel_with_per_layer_inputs_is_a_one_line_error():
    """Sequence parallel splits the hidden states and not the per-layer inputs: refused when the config is
    finalized, for the text model and the model with images alike."""
    import dataclasses

    from longspan.core.errors import NotSupportedError
    from longspan.families.gemma4.vl_provider import Gemma4VLModelProvider
    from tests.parallel.test_gemma4_layouts import _model

    text = _model(moe=False)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=64)
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text) if f.init}
    for provider in (text, Gemma4VLModelProvider(**fields, vision_config=vision)):
        provider.tensor_model_parallel_size, provider.sequence_parallel = 2, True
        with pytest.raises(NotSupportedError, match=r"^model\.sequence_parallel=True with "
                           r"model\.per_layer_embed_dim=4 is not supported yet for Gemma 4") as error:
            provider.finalize()
        assert "\n" not in str(error.value)


def test_context_parallel_keeps_the_full_layers_mask_of_a_sliding_only_two_sided_mask(monkeypatch):
    """Gemma 4's image blocks reach only its sliding-window layers (``sliding_only``; the full-attention layers get
    ``full_layers``): context parallel cuts both masks' query rows to this rank's and keeps which is which. (The
    parity test above cannot see the full-attention layers' mask: its one full-attention layer is the last,
    whose outputs at the image tokens feed no loss.)"""
    import torch
    import torch.distributed as dist
    from torch import nn

    from longspan.models.sliding_window import TwoSidedMask
    from longspan.parallel import context_parallel as cp

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    module = nn.Module()
    setattr(module, cp.CONTEXT_PARALLEL_ATTR, object())
    s = 8
    blocks = torch.rand(1, 1, s, s) > 0.5
    full = torch.rand(1, 1, s, s) > 0.5
    idx = cp.load_balanced_indices(s, 2, 1, device=torch.device("cpu"))
    for full_layers in (full, None):
        _, kwargs = cp._slice_inputs(module, (torch.zeros(1, s, dtype=torch.long),),
                                     {"attention_mask": TwoSidedMask(blocks, sliding_only=True,
                                                                     full_layers=full_layers)})
        mask = kwargs["attention_mask"]
        assert isinstance(mask, TwoSidedMask) and mask.sliding_only
        assert torch.equal(mask.mask, blocks[..., idx, :])
        assert (mask.full_layers is None) if full_layers is None else torch.equal(mask.full_layers, full[..., idx, :])
