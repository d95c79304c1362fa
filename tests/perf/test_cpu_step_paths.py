"""The CPU step's fast paths (benchmarks/bench_train_step.py) keep the maths of the plain ones.

- ``fused_linear_cross_entropy`` (the logits' gradient formed in the forward) gives ``F.cross_entropy``'s losses
  and gradients, ignored labels included, and the GPT model takes it for a training forward only;
- rotary embeddings via ``roll`` and a signed sine equal the rotate_half form bit for bit;
- ``RMSNorm``'s hand-written backward gives the composite ``F.rms_norm`` form's output and gradients;
- the optimizer on a CPU is torch's fused AdamW / SGD and follows the foreach one within 1e-6 over steps.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from longspan.config.schema.optim import OptimizerConfig
from longspan.models.gpt import build_gpt_model
from longspan.models.loss import LogitsWorkspace, fused_linear_cross_entropy
from longspan.models.rope import apply_rotary
from longspan.models.transformer import RMSNorm
from longspan.training.optim.optimizer import get_megatron_optimizer
from tests.models.gpt_test_config import llama_config


def _labels(shape: tuple[int, ...], vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, shape, generator=g)
    labels.view(-1)[torch.randperm(labels.numel(), generator=g)[: labels.numel() // 5]] = -100  # uneven ignores
    return labels


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # float32 rounding of a different summation order, relative to the tensor's scale
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


def test_fused_linear_cross_entropy_equals_plain_losses_and_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16)
    weight = torch.randn(50, 16) * 0.3
    labels = _labels((3, 7), 50, seed=1)
    upstream = torch.rand(3, 7)  # uneven per-token gradients (a loss mask and a token count)

    def run(loss_fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        losses = loss_fn(h, w)
        (losses * upstream).sum().backward()
        return losses.detach(), h.grad, w.grad

    ref = run(lambda h, w: F.cross_entropy(F.linear(h, w).flatten(0, 1), labels.flatten(), reduction="none")
              .view(3, 7))
    out = run(lambda h, w: fused_linear_cross_entropy(h, w, labels))
    assert out[0].dtype == torch.float32 and out[0].shape == (3, 7)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-6)
    assert torch.all(out[0][labels == -100] == 0)
    _close(out[1], ref[1])
    _close(out[2], ref[2])
    assert torch.all(out[1][labels == -100] == 0)  # an ignored token sends no gradient back


def test_logits_workspace_reuses_buffers_only_once_released():
    torch.manual_seed(0)
    hidden, weight = torch.randn(12, 8), torch.randn(40, 8)
    labels = _labels((12,), 40, seed=2)
    workspace = LogitsWorkspace()

    def step(retain: bool = False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        losses = fused_linear_cross_entropy(h, w, labels, workspace)
        losses.sum().backward(retain_graph=retain)
        return losses, h, w

    first = step()
    pointers = {buf.data_ptr() for buf, _ in workspace._buffers}
    assert len(pointers) == 2  # the logits and their gradient
    second = step()
    assert {buf.data_ptr() for buf, _ in workspace._buffers} == pointers  # reused, nothing new allocated
    for a, b in zip((first[0], first[1].grad, first[2].grad), (second[0], second[1].grad, second[2].grad)):
        assert torch.equal(a, b)
    # A graph kept for a second backward keeps its gradient buffer: the next forward takes another one.
    losses, h, w = step(retain=True)
    expected = h.grad.clone()
    step()
    h.grad = None
    losses.sum().backward()
    assert torch.equal(h.grad, expected)
    assert len(workspace._buffers) == 3


def _fused_in_graph(losses: torch.Tensor) -> bool:
    """Whether the losses come from the fused node (behind the final reshape)."""
    node = losses.grad_fn
    while node is not None and type(node).__name__ == "ViewBackward0":
        node = node.next_functions[0][0]
    return node is not None and "GradInForward" in type(node).__name__


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_training_loss_takes_the_fused_path_with_the_plain_gradients(tied):
    torch.manual_seed(0)
    model = build_gpt_model(llama_config(share_embeddings_and_output_weights=tied), seed=3)
    tokens = torch.randint(0, 128, (2, 16))
    labels = _labels((2, 16), 128, seed=4)
    mask = torch.rand(2, 16)

    losses = model(tokens, labels=labels)
    assert _fused_in_graph(losses)
    (losses * mask).sum().backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    logits = model(tokens)  # the plain path: logits, then F.cross_entropy
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 16)
    (ref * mask).sum().backward()
    torch.testing.assert_close(losses.detach(), ref.detach(), rtol=1e-6, atol=1e-6)
    for name, param in model.named_parameters():
        _close(fused_grads[name], param.grad)


def test_gpt_loss_keeps_the_plain_path_where_the_fused_one_does_not_apply():
    torch.manual_seed(0)
    model = build_gpt_model(llama_config(), seed=3)
    tokens = torch.randint(0, 128, (2, 8))
    labels = _labels((2, 8), 128, seed=5)
    train = model(tokens, labels=labels)
    with torch.no_grad():  # evaluation: no gradient buffer is formed
        evaluated = model(tokens, labels=labels)
    torch.testing.assert_close(evaluated, train.detach(), rtol=1e-6, atol=1e-6)
    handle = model.output_layer.register_forward_hook(lambda mod, args, out: out)  # a plan's hook must run
    try:
        hooked = model(tokens, labels=labels)
    finally:
        handle.remove()
    assert not _fused_in_graph(hooked)
    torch.testing.assert_close(hooked, train, rtol=1e-6, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _fused_in_graph(model(tokens, labels=labels))


@pytest.mark.parametrize("rot_dim", [16, 8])
def test_rotary_via_roll_equals_rotate_half_bit_for_bit(rot_dim):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 16)
    freqs = torch.randn(2, 5, 1, rot_dim // 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x1, x2 = x[..., :rot_dim].chunk(2, dim=-1)
    rotated = x[..., :rot_dim] * cos + torch.cat((-x2, x1), dim=-1) * sin
    expected = torch.cat((rotated, x[..., rot_dim:]), dim=-1)
    assert torch.equal(apply_rotary(x, cos, sin), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_function_equals_the_composite_form(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x0 = torch.randn(3, 5, 16).to(dtype)
    upstream = torch.randn(3, 5, 16).to(dtype)

    def run(forward):
        x = x0.clone().requires_grad_()
        norm.weight.grad = None
        out = forward(x)
        out.backward(upstream)
        return out.detach(), x.grad, norm.weight.grad

    ref = run(lambda x: norm.weight * F.rms_norm(x.float(), (16,), eps=1e-5).to(dtype))
    out = run(norm)
    assert torch.equal(out[0], ref[0])
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for actual, expected in zip(out[1:], ref[1:]):
        assert actual.dtype == dtype
        torch.testing.assert_close(actual, expected, **tol)


def _opt_config(name: str) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=name, lr=1e-2, min_lr=0.0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        sgd_momentum=0.9, clip_grad=1.0, bf16=False, fp16=False, params_dtype=torch.float32, loss_scale=None,
        use_distributed_optimizer=False, log_num_zeros_in_grad=False, decoupled_weight_decay=True,
        decoupled_lr=None, decoupled_min_lr=None,
    )


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_cpu_optimizer_is_fused_and_follows_the_foreach_one(name):
    models = [build_gpt_model(llama_config(), seed=7) for _ in range(2)]
    opt = get_megatron_optimizer(_opt_config(name), [models[0]])
    assert all(group["fused"] for group in opt.param_groups)
    cls = torch.optim.AdamW if name == "adam" else torch.optim.SGD
    kwargs = dict(betas=(0.9, 0.95), eps=1e-8) if name == "adam" else dict(momentum=0.9)
    # The same groups (weight decay on matrices only) over the second model's parameters, foreach kernels.
    by_name = dict(models[1].named_parameters())
    names = {id(p): n for n, p in models[0].named_parameters()}
    groups = [{"params": [by_name[names[id(p)]] for p in group["params"]], "weight_decay": group["weight_decay"]}
              for group in opt.param_groups]
    ref = cls(groups, lr=1e-2, foreach=True, **kwargs)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        for (_, p0), (_, p1) in zip(models[0].named_parameters(), models[1].named_parameters()):
            p0.grad = torch.randn(p0.shape, generator=g)
            p1.grad = p0.grad.clone()
        opt.step()  # clips to norm 1.0 first
        torch.nn.utils.clip_grad_norm_(models[1].parameters(), 1.0)
        ref.step()
    for (n, p0), (_, p1) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(p0, p1, rtol=1e-6, atol=1e-6, msg=n)


@pytest.mark.slow
def test_fused_loss_compiles_with_a_workspace():
    # Inside a compiled graph the workspace hands out plain torch.empty buffers (no reference counting traced).
    torch.manual_seed(0)
    hidden, weight = torch.randn(12, 8), torch.randn(40, 8)
    labels = _labels((12,), 40, seed=6)
    workspace = LogitsWorkspace()

    def run(loss_fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        losses = loss_fn(h, w, labels, workspace)
        losses.sum().backward()
        return losses.detach(), h.grad, w.grad

    for actual, expected in zip(run(torch.compile(fused_linear_cross_entropy)), run(fused_linear_cross_entropy)):
        _close(actual, expected)
