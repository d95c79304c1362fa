"""model.num_microbatches_with_partial_activation_checkpoints on a 2-stage pipeline.

Oracle for which microbatches recompute every layer: megatron-core's rule (schedules.py, 1F1B without
interleaving), written out here: the rank's k-th forward recomputes all layers when
``k % (warmup + 1) >= N``, warmup = pp - rank - 1. Oracle for the numbers: the same model on one process.
"""

from __future__ import annotations

import pytest

from longspan.core.errors import ConfigError
from tests.parallel.test_pipeline import _cfg, _forward_step, _microbatches, _reference

MICROBATCHES = 4
PARTIAL = 1  # N


def _case() -> dict:
    import torch

    from longspan.parallel.init import initialize_distributed
    from longspan.parallel.pipeline import build_pipeline_chunks, unwrap_chunk
    from longspan.training.step.pipeline_schedules import forward_backward_pipelining

    def recompute_block(cfg):
        cfg.model.recompute_granularity, cfg.model.recompute_method, cfg.model.recompute_num_layers = "full", "block", 1
        return cfg

    cfg = recompute_block(_cfg(2))
    cfg.model.num_microbatches_with_partial_activation_checkpoints = PARTIAL
    parallel = initialize_distributed(cfg.dist, cfg.model, device="cpu")
    chunks = build_pipeline_chunks(cfg, parallel, cfg.rng.seed)
    layer_calls = []
    for chunk in chunks:
        for layer in unwrap_chunk(chunk).decoder.layers.values():
            layer.register_forward_pre_hook(lambda *_: layer_calls.append(1))  # pre: a replay may stop early
    reports, _ = forward_backward_pipelining(
        forward_step_func=_forward_step, data_iterator=iter(_microbatches(MICROBATCHES)), model=chunks,
        num_microbatches=MICROBATCHES, calculate_per_token_loss=False, schedule="1f1b",
    )
    ref_reports, _, ref_grads = _reference(recompute_block(_cfg(1)), MICROBATCHES, False)
    worst = 0.0
    for chunk in chunks:
        for name, param in unwrap_chunk(chunk).named_parameters():
            ref = ref_grads[name]
            worst = max(worst, float((param.grad - ref).abs().max() / ref.abs().max().clamp(min=1e-12)))
    losses = torch.tensor([float(r["lm loss"][0] / r["lm loss"][1]) for r in reports])
    ref_losses = torch.tensor([float(r["lm loss"][0] / r["lm loss"][1]) for r in ref_reports])
    return {"rank": parallel.pp_rank, "layer_calls": len(layer_calls), "grad_rel_err": worst,
            "loss_rel_err": float(((losses - ref_losses).abs() / ref_losses.abs()).max())}


def test_first_microbatches_of_each_window_keep_the_partial_recompute(pool2):
    results = pool2.run(_case, timeout=120)
    for res in results:
        warmup = 2 - res["rank"] - 1
        all_layers = sum(k % (warmup + 1) >= PARTIAL for k in range(MICROBATCHES))
        # 2 layers per stage: each microbatch's forward (2), then the replay of 1 layer, or of 2 for the others
        expected = MICROBATCHES * 2 + (MICROBATCHES - all_layers) * 1 + all_layers * 2
        assert res["layer_calls"] == expected, res
        assert res["grad_rel_err"] < 1e-5 and res["loss_rel_err"] < 1e-5, res
    # rank 0 (warmup 1) recomputes every layer for microbatches 1 and 3; rank 1 (warmup 0) never
    assert [r["layer_calls"] for r in sorted(results, key=lambda r: r["rank"])] == [14, 12]


@pytest.mark.parametrize("overrides, needle", [
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, "'uniform'"),
    ({}, "recompute_granularity='full'"),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1,
      "num_microbatches_with_partial_activation_checkpoints": -1}, ">= 0"),
])
def test_partial_checkpoints_need_block_recompute(overrides, needle):
    from longspan.models.gpt import resolve_model_args

    cfg = _cfg(1)
    overrides = {"num_microbatches_with_partial_activation_checkpoints": 2, **overrides}
    for name, value in overrides.items():
        setattr(cfg.model, name, value)
    with pytest.raises(ConfigError) as info:
        resolve_model_args(cfg.model)
    assert needle in str(info.value) and "\n" not in str(info.value)
