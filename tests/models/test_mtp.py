"""Multi-token prediction (longspan.models.mtp): megatron-core's shifts, the loss against a hand-written
reference on a tiny model with uneven masks, the objective (factor 0 leaves the model exactly as without MTP,
factor > 0 changes the gradients), the config rules, and the training log's ``mtp_1 loss``."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from longspan.config.rules.model import check_mtp
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.gpt import build_gpt_model
from longspan.models.gpt_provider import GPTModelProvider
from longspan.models.mtp import MTPLossAutoScaler, roll_left, set_mtp_loss_scale

VOCAB, SEQ, BATCH = 48, 12, 3


def provider(**overrides) -> GPTModelProvider:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                  vocab_size=VOCAB, seq_length=SEQ, normalization="RMSNorm", gated_linear_unit=True,
                  activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                  share_embeddings_and_output_weights=False, make_vocab_size_divisible_by=16,
                  position_embedding_type="rope")
    fields.update(overrides)
    return GPTModelProvider(**fields)


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.3).float()
    mask[1, 7:] = 0.0  # uneven: a row with a padded tail
    mask[2, :2] = 0.0
    return ids, labels, mask


@pytest.fixture(autouse=True)
def unit_loss_scale():
    set_mtp_loss_scale(1.0)
    yield
    MTPLossAutoScaler.main_loss_backward_scale = None


def main_objective(model, ids, labels, mask, **kwargs) -> torch.Tensor:
    losses = model(ids, labels=labels, loss_mask=mask, **kwargs)
    return (losses * mask).sum() / mask.sum()


# ------------------------------------------------------------------------------------------------ shifts

def test_roll_left_matches_megatron_core() -> None:
    from megatron.core.transformer.multi_token_prediction import _roll_tensor_packed_seq, roll_tensor

    x = torch.arange(1, 1 + 2 * 10).view(2, 10)
    expected, _ = roll_tensor(x.clone(), shifts=-1, dims=-1)
    assert torch.equal(roll_left(x), expected)
    cu = torch.tensor([0, 3, 4, 8, 10])
    packed = types.SimpleNamespace(cu_seqlens_q=cu)
    expected, _ = _roll_tensor_packed_seq(x.clone(), -1, -1, packed)
    assert torch.equal(roll_left(x, cu), expected)
    # per-row boundaries, padded by repeating the end (the packed SFT collate's form)
    rows = torch.tensor([[0, 3, 4, 8, 10], [0, 6, 10, 10, 10]])
    got = roll_left(x, rows)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], torch.tensor([12, 13, 14, 15, 16, 0, 18, 19, 20, 0]))


# ------------------------------------------------------------------------------------------------ the loss

def reference_objective(model, ids, labels, mask, factor: float, depths: int) -> tuple[torch.Tensor, list]:
    """The main masked mean plus factor/D times each depth's masked mean, written out by hand: shift by k with
    zero fill, enorm(embed) ++ hnorm(h) -> eh_proj -> layer -> final norm -> shared output layer."""
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    rotary = model.rotary_pos_emb(positions) if model.rotary_pos_emb is not None else None
    h = model.decoder(model.embedding(ids, positions), rotary, None)
    weight = model.output_layer.weight
    ce = lambda hidden, target: F.cross_entropy((hidden @ weight.T).flatten(0, 1), target.flatten(), reduction="none")
    main = (ce(h, labels).view(BATCH, SEQ) * mask).sum() / mask.sum()

    def shift(t: torch.Tensor, k: int) -> torch.Tensor:
        return torch.cat([t[:, k:], torch.zeros_like(t[:, :k])], dim=1)

    total, per_depth = main, []
    for k in range(1, depths + 1):
        layer = model.mtp.layers[k - 1]
        embedded = model.embedding.word_embeddings(shift(ids, k))
        if model.embedding.position_embeddings is not None:  # learned positions, shifted (0 at the end)
            embedded = embedded + model.embedding.position_embeddings(shift(positions, k))
        h = layer.eh_proj(torch.cat([layer.enorm(embedded), layer.hnorm(h)], dim=-1))
        h = layer.final_layernorm(layer.transformer_layer(h, rotary, None))
        mask_k = shift(mask, k)
        loss_k = (ce(h, shift(labels, k)).view(BATCH, SEQ) * mask_k).sum() / mask_k.sum()
        per_depth.append(loss_k)
        total = total + factor / depths * loss_k
    return total, per_depth


@pytest.mark.parametrize("depths,positions", [(1, "rope"), (2, "rope"), (2, "learned_absolute")])
def test_mtp_loss_and_gradients_equal_the_hand_written_reference(depths: int, positions: str) -> None:
    factor = 0.3
    config = provider(mtp_num_layers=depths, mtp_loss_scaling_factor=factor, position_embedding_type=positions)
    model = build_gpt_model(config, seed=3)
    model.train()
    ids, labels, mask = batch()
    objective = main_objective(model, ids, labels, mask)
    objective.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    logged, steps = model.mtp.take_losses()
    model.zero_grad()
    expected_total, expected_depths = reference_objective(model, ids, labels, mask, factor, depths)
    expected_total.backward()
    assert steps == 1
    for k in range(depths):
        want = expected_depths[k].detach().double()
        torch.testing.assert_close(torch.tensor(logged[k], dtype=torch.float64), want, rtol=1e-6, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert grads["mtp.layers.0.eh_proj.weight"].abs().sum() > 0


def test_factor_zero_leaves_loss_and_gradients_exactly_as_without_mtp() -> None:
    plain = build_gpt_model(provider(hidden_dropout=0.1, attention_dropout=0.1), seed=5)
    with_mtp = build_gpt_model(provider(hidden_dropout=0.1, attention_dropout=0.1, mtp_num_layers=2,
                                        mtp_loss_scaling_factor=0.0), seed=5)
    for name, param in plain.named_parameters():
        assert torch.equal(param, with_mtp.get_parameter(name)), name
    ids, labels, mask = batch(1)
    results = []
    for model in (plain, with_mtp):
        model.train()
        torch.manual_seed(11)
        losses = model(ids, labels=labels, loss_mask=mask)
        ((losses * mask).sum() / mask.sum()).backward()
        results.append(losses.detach())
    assert torch.equal(results[0], results[1])
    for name, param in plain.named_parameters():
        assert torch.equal(param.grad, with_mtp.get_parameter(name).grad), name


def test_a_positive_factor_changes_the_shared_gradients() -> None:
    ids, labels, mask = batch(2)
    grads = []
    for factor in (0.0, 0.5):
        model = build_gpt_model(provider(mtp_num_layers=1, mtp_loss_scaling_factor=factor), seed=7)
        main_objective(model, ids, labels, mask).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in ("embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_q.weight",
                 "output_layer.weight"):
        assert not torch.allclose(grads[0][name], grads[1][name]), name
    assert grads[0]["mtp.layers.0.eh_proj.weight"].abs().max() == 0
    assert grads[1]["mtp.layers.0.eh_proj.weight"].abs().max() > 0


def test_the_autoscaler_scale_and_per_token_loss_set_the_mtp_gradient() -> None:
    ids, labels, mask = batch(3)
    grads = {}
    for name, overrides, scale in (("mean", {}, 1.0), ("half", {}, 0.5),
                                   ("sum", {"calculate_per_token_loss": True}, 1.0)):
        model = build_gpt_model(provider(mtp_num_layers=1, mtp_loss_scaling_factor=1.0, **overrides), seed=9)
        set_mtp_loss_scale(scale)
        model(ids, labels=labels, loss_mask=mask).sum().mul(0.0).backward()  # the MTP gradient alone
        grads[name] = model.mtp.layers[0].eh_proj.weight.grad
    torch.testing.assert_close(grads["half"], grads["mean"] * 0.5)
    tokens = float(mask[:, 1:].sum())  # the depth-1 mask: shifted by one, last position empty
    torch.testing.assert_close(grads["sum"], grads["mean"] * tokens, rtol=1e-4, atol=1e-6)


def test_packed_documents_stop_the_shift_at_their_boundaries() -> None:
    model = build_gpt_model(provider(mtp_num_layers=1, mtp_loss_scaling_factor=1.0), seed=4)
    ids, labels, mask = batch(4)
    mask = torch.ones_like(mask)
    cu = torch.tensor([[0, 5, SEQ, SEQ]] * BATCH)
    model(ids, labels=labels, loss_mask=mask, cu_seqlens=cu)
    with_boundaries, _ = model.mtp.take_losses()
    model(ids, labels=labels, loss_mask=mask)
    plain, _ = model.mtp.take_losses()
    assert with_boundaries[0] != plain[0]


def test_eval_and_inference_forwards_do_not_log_and_logits_are_the_main_head() -> None:
    plain = build_gpt_model(provider(), seed=2)
    model = build_gpt_model(provider(mtp_num_layers=1), seed=2)
    ids, labels, mask = batch(5)
    model.eval()
    with torch.no_grad():
        model(ids, labels=labels, loss_mask=mask)
        assert model.mtp.take_losses()[1] == 0
        assert torch.equal(model(ids), plain(ids))


# ------------------------------------------------------------------------------------------------ rules

def test_mtp_config_rules() -> None:
    check_mtp(provider(mtp_num_layers=2))
    with pytest.raises(ConfigError, match=r"model.mtp_num_layers=0 must be a positive integer"):
        check_mtp(provider(mtp_num_layers=0))
    with pytest.raises(ConfigError, match=r"model.mtp_loss_scaling_factor=-1.0"):
        check_mtp(provider(mtp_num_layers=1, mtp_loss_scaling_factor=-1.0))
    with pytest.raises(NotSupportedError, match=r"mtp_num_layers=1 with model.pipeline_model_parallel_size=2 .*"
                                                r"model.share_embeddings_and_output_weights=True"):
        build_gpt_model(provider(mtp_num_layers=1, pipeline_model_parallel_size=2,
                                 share_embeddings_and_output_weights=True), materialize=False)
    check_mtp(provider(mtp_num_layers=1, pipeline_model_parallel_size=2))  # untied: the last stage copies
    # context and sequence parallel place the depths too (tests/parallel/test_deepseek_context_parallel.py)
    check_mtp(provider(mtp_num_layers=1, context_parallel_size=2))
    check_mtp(provider(mtp_num_layers=1, tensor_model_parallel_size=2, sequence_parallel=True))


def test_mamba_refuses_mtp() -> None:
    from longspan.config.rules.model import check_mamba_model
    from longspan.models.mamba_provider import MambaProvider

    config = MambaProvider(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ,
                           mtp_num_layers=1)
    with pytest.raises(NotSupportedError, match=r"model.mtp_num_layers=1 is not supported yet for MambaProvider"):
        check_mamba_model(config)


# ------------------------------------------------------------------------------------------------ the log

def test_training_logs_mtp_losses(tmp_path: Path) -> None:
    import logging

    from longspan.training.pretrain import pretrain
    from longspan.training.step.forward_step import forward_step
    from tests.training.pretrain_helpers import read_metrics, small_config

    messages: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    cfg = small_config(tmp_path, train_iters=3, eval_interval=None)
    cfg.model.mtp_num_layers = 2
    logger, handler = logging.getLogger("longspan"), Capture(level=logging.INFO)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        pretrain(cfg, forward_step)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    records = read_metrics(cfg)
    assert len(records) == 3
    for record in records:
        losses = record["losses"]
        assert {"lm loss", "mtp_1 loss", "mtp_2 loss"} <= set(losses)
        assert losses["mtp_1 loss"] > 0 and losses["mtp_2 loss"] > 0 and losses["mtp_1 loss"] != losses["lm loss"]
    lines = [m for m in messages if " iteration " in m and "consumed samples" in m]
    assert lines and all("mtp_1 loss:" in line and "mtp_2 loss:" in line for line in lines)


def test_moe_models_build_moe_depths_numbered_after_the_decoder(tmp_path: Path) -> None:
    from longspan.models.moe import MoELayer, moe_layer_metrics
    from longspan.training.pretrain import pretrain
    from longspan.training.step.forward_step import forward_step
    from tests.training.pretrain_helpers import read_metrics, small_config

    config = provider(mtp_num_layers=2, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24)
    model = build_gpt_model(config, seed=1)
    assert [type(d.transformer_layer.mlp) for d in model.mtp.layers] == [MoELayer, MoELayer]
    ids, labels, mask = batch(6)
    main_objective(model, ids, labels, mask).backward()
    assert sorted(moe_layer_metrics(model)) == [0, 1, 2, 3]
    assert model.mtp.layers[1].transformer_layer.mlp.router.weight.grad.abs().sum() > 0

    cfg = small_config(tmp_path, train_iters=2, eval_interval=None)
    cfg.model.mtp_num_layers = 1
    cfg.model.num_moe_experts = 4
    cfg.model.moe_router_topk = 2
    pretrain(cfg, forward_step)
    losses = read_metrics(cfg)[-1]["losses"]
    assert "mtp_1 loss" in losses and "load_imbalance" in losses  # the depth's MoE layer is row 2 of its table


def test_the_forward_step_passes_the_loss_mask_and_documents_only_with_mtp() -> None:
    from longspan.training.step.forward_step import _mtp_inputs

    batch_ = {"tokens": torch.zeros(1, 4), "loss_mask": torch.ones(1, 4), "cu_seqlens": torch.tensor([[0, 2, 4]])}
    state = types.SimpleNamespace(cfg=types.SimpleNamespace(model=provider()))
    assert _mtp_inputs(state, batch_) == {}
    state.cfg.model = provider(mtp_num_layers=1)
    inputs = _mtp_inputs(state, batch_)
    assert set(inputs) == {"loss_mask", "cu_seqlens"} and inputs["cu_seqlens"] is batch_["cu_seqlens"]
    del batch_["cu_seqlens"]
    assert set(_mtp_inputs(state, batch_)) == {"loss_mask"}
