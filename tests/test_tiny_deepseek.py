"""``tiny-deepseek`` (MLA with query compression, a dense first layer, DeepSeek MoE with shared experts and the
aux-loss-free expert bias, one multi-token-prediction depth) through pretrain() on the builtin corpus: the recipe
validates, its loss falls, stop-and-resume is bit-exact (dropout on; the routing biases travel in the
checkpoint; the logged ``mtp_1 loss`` too), and the trained checkpoint exports as DeepseekV3ForCausalLM, MTP
layer included, with transformers' logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import logging

import pytest
import torch

from longspan.recipes import get_recipe
from longspan.training.pretrain import pretrain
from longspan.training.step.forward_step import forward_step
from tests.training.pretrain_helpers import losses_by_iteration, read_metrics

ITERS = 12


def small_run(tmp_path: Path, name: str, dropout: float = 0.0, **train_overrides: Any):
    """``tiny-deepseek`` on the builtin corpus, shortened to seconds: 64-token sequences, 12 iterations of
    4 microbatches of 2, evaluation every 6 iterations."""
    cfg = get_recipe("tiny-deepseek")
    cfg.model.seq_length = cfg.dataset.sequence_length = 64
    cfg.model.hidden_dropout = cfg.model.attention_dropout = dropout
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.eval_interval, t.eval_iters = 2, 8, ITERS, 6, 1
    for key, value in train_overrides.items():
        setattr(t, key, value)
    cfg.scheduler.lr_warmup_fraction, cfg.scheduler.lr_warmup_iters = None, 2
    run_dir = tmp_path / name
    cfg.checkpoint.save = cfg.checkpoint.load = str(run_dir / "ckpt")
    cfg.checkpoint.save_interval = None
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = str(run_dir / "tb")
    return cfg


def test_recipe_validates_and_builds_a_deepseek_model() -> None:
    cfg = get_recipe("tiny-deepseek")
    cfg.validate()
    cfg.model.finalize()
    model = cfg.model.provide_meta()
    layers = model.decoder.layers
    assert type(layers["0"].self_attention).__name__ == "MLASelfAttention"
    assert layers["0"].self_attention.linear_q_down_proj is not None  # query compression
    assert type(layers["0"].mlp).__name__ == "MLP"
    for mlp in [layers[i].mlp for i in ("1", "2", "3")] + [model.mtp.layers[0].transformer_layer.mlp]:
        assert mlp.shared_experts is not None and mlp.router.expert_bias is not None
        assert mlp.experts.linear_fc1.weight.shape[0] == 8
    assert len(model.mtp.layers) == 1 and model.mtp.loss_scaling_factor == 0.1


def _mtp_losses(cfg) -> dict[int, float]:
    return {r["iteration"]: r["losses"]["mtp_1 loss"] for r in read_metrics(cfg)}


@pytest.mark.slow
def test_loss_falls_resume_is_bit_exact_and_the_checkpoint_exports(tmp_path: Path) -> None:
    lines: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    straight = small_run(tmp_path, "straight", dropout=0.1)
    logger, handler = logging.getLogger("longspan"), Grab(level=logging.INFO)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        assert pretrain(straight, forward_step).train_state.step == ITERS
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    iteration_lines = [line for line in lines if " iteration " in line and "lm loss:" in line]
    assert len(iteration_lines) == ITERS and all("mtp_1 loss:" in line for line in iteration_lines)
    reference, reference_mtp = losses_by_iteration(straight), _mtp_losses(straight)
    assert sorted(reference) == sorted(reference_mtp) == list(range(1, ITERS + 1))
    assert sum(reference[i] for i in (10, 11, 12)) < sum(reference[i] for i in (1, 2, 3)) - 0.3, reference
    assert sum(reference_mtp[i] for i in (10, 11, 12)) < sum(reference_mtp[i] for i in (1, 2, 3)), reference_mtp

    stopped = small_run(tmp_path, "resumed", dropout=0.1, exit_interval=5)
    assert pretrain(stopped, forward_step).train_state.step == 5
    resumed_cfg = small_run(tmp_path, "resumed", dropout=0.1)
    pretrain(resumed_cfg, forward_step)
    resumed, resumed_mtp = losses_by_iteration(resumed_cfg), _mtp_losses(resumed_cfg)
    assert [resumed[i] for i in range(1, ITERS + 1)] == [reference[i] for i in range(1, ITERS + 1)]
    assert [resumed_mtp[i] for i in range(1, ITERS + 1)] == [reference_mtp[i] for i in range(1, ITERS + 1)]

    _check_checkpoint_exports(straight, tmp_path)


def _check_checkpoint_exports(cfg, tmp_path: Path) -> None:
    import transformers

    from longspan.conversion import AutoBridge
    from longspan.training.checkpointing.model_loading import load_model_from_checkpoint
    from tests.conversion.parity import tensors

    loaded = load_model_from_checkpoint(cfg.checkpoint.save, device="cpu")
    (model,) = loaded.model
    biases = [m.expert_bias for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    assert len(biases) == 4 and all(b.abs().max() > 0 for b in biases)  # the routing biases moved and were saved
    bridge = AutoBridge.from_longspan_provider(loaded.cfg.model)
    assert bridge.family.architecture == "DeepseekV3ForCausalLM"
    bridge.save_hf_pretrained([model], tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
    assert hf.config.num_nextn_predict_layers == 1
    ids = torch.randint(0, 200, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()(ids)[..., : hf.config.vocab_size]
        assert (hf(ids).logits - ours).abs().max().item() <= 1e-5
    # the MTP layer is model.layers.4 (after the 4 decoder layers) and imports back bit for bit
    exported = tensors(tmp_path / "hf")
    assert torch.equal(exported["model.layers.4.eh_proj.weight"], model.mtp.layers[0].eh_proj.weight)
    assert torch.equal(exported["model.layers.4.embed_tokens.weight"], exported["model.embed_tokens.weight"])
    (again,) = AutoBridge.from_hf_pretrained(tmp_path / "hf").to_megatron_model()
    theirs = dict(again.named_parameters())
    for name, param in model.named_parameters():
        if name.startswith("mtp."):
            assert torch.equal(theirs[name], param), name
