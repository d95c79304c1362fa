"""NF4 storage and the QLoRA linear layer: packing round trip, the quantization error bound, the input-only
gradient recomputed in backward, and the NF4 model's logits against the full-precision model's.

Error bound. Every weight ``w`` of a block with absmax ``a`` maps to the nearest NF4 code ``c`` of ``w / a``, so
``|w - c·a| <= a · g/2`` where ``g`` is the gap between the two codes around ``w / a``, at most the widest gap
(between -1 and -0.6961928): ``NF4_MAX_HALF_GAP ≈ 0.1519``. A linear output then deviates by at most
``sum_j |x_j| · a(block of j) · NF4_MAX_HALF_GAP`` (Hölder, per row), checked exactly below. Through the whole
model the NF4 forward IS the forward of the model whose weights are the dequantized ones (checked to float
rounding), so its logits differ from the full-precision logits only through those bounded weight changes;
end to end the test asserts the first-order bound: the relative logits change is at most the sum over the
linears a token passes in series (4 per layer) of their relative weight errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.peft import DoRA, LoRA
from longspan.peft.nf4 import (NF4_CODES, NF4_MAX_HALF_GAP, NF4LinearFunction, dequantize_nf4, nf4_linear,
                               quantize_nf4)
from longspan.peft.qlora import NF4LoRALinear, quantize_base_weights


def test_codes_are_sorted_with_exact_zero_and_ends() -> None:
    assert list(NF4_CODES) == sorted(NF4_CODES) and len(NF4_CODES) == 16
    assert NF4_CODES[0] == -1.0 and NF4_CODES[7] == 0.0 and NF4_CODES[-1] == 1.0
    assert NF4_MAX_HALF_GAP == pytest.approx((1.0 - 0.6961928009986877) / 2)


def test_codes_round_trip_exactly_and_packing_is_two_per_byte() -> None:
    codes = torch.tensor(NF4_CODES)
    index = torch.randint(0, 16, (6, 128), generator=torch.Generator().manual_seed(0))
    absmax = torch.tensor([[0.5, 2.0]] * 6)
    weight = codes[index] * absmax.repeat_interleave(64, dim=1)
    weight[:, 0], weight[:, 64] = 0.5, -2.0  # each block holds its absmax
    packed, scales = quantize_nf4(weight)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 64) and scales.shape == (6, 2)
    assert torch.equal(dequantize_nf4(packed, scales, 128), weight)


@pytest.mark.parametrize("cols", [128, 100, 30])
def test_error_within_half_the_widest_code_gap_times_absmax(cols: int) -> None:
    weight = torch.randn(33, cols, generator=torch.Generator().manual_seed(1)) * 0.02
    weight[3, 5] = 0.3  # an outlier: its block's scale grows, the others' do not
    weight[4, :] = 0.0  # an all-zero row stays zero
    packed, absmax = quantize_nf4(weight)
    restored = dequantize_nf4(packed, absmax, cols)
    assert restored.shape == weight.shape and torch.all(restored[4] == 0)
    per_weight_absmax = absmax.repeat_interleave(64, dim=1)[:, :cols]
    error = (restored - weight).abs()
    assert torch.all(error <= per_weight_absmax * NF4_MAX_HALF_GAP * (1 + 1e-6))
    # the bound is nearly reached by Gaussian weights (the widest gap is near the ends, rarely hit)
    assert error.max() > 0.2 * (per_weight_absmax * NF4_MAX_HALF_GAP).max()


def test_linear_output_within_the_derived_bound_and_gradient_is_input_only() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(48, 192, generator=gen) * 0.05
    x = torch.randn(5, 7, 192, generator=gen, requires_grad=True)
    packed, absmax = quantize_nf4(weight)
    dequantized = dequantize_nf4(packed, absmax, 192)
    out = nf4_linear(x, packed, absmax, 192)
    assert torch.allclose(out, F.linear(x, dequantized), rtol=1e-6, atol=1e-6)
    bound = x.detach().abs() @ (absmax.repeat_interleave(64, dim=1) * NF4_MAX_HALF_GAP).T
    assert torch.all((out - F.linear(x, weight)).abs() <= bound * (1 + 1e-5) + 1e-6)
    grad = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, grad)
    assert torch.allclose(gx, grad @ dequantized, rtol=1e-6, atol=1e-6)


def test_backward_recomputes_the_weight_instead_of_keeping_it() -> None:
    packed, absmax = quantize_nf4(torch.randn(64, 64))
    x = torch.randn(3, 64, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        NF4LinearFunction.apply(x, packed, absmax, 64).sum().backward()
    assert saved and all(t.dtype in (torch.uint8, torch.float32) and t.numel() <= packed.numel() for t in saved)
    assert not any(t.shape == (64, 64) and t.is_floating_point() for t in saved)


def test_bf16_autocast_computes_in_bf16() -> None:
    packed, absmax = quantize_nf4(torch.randn(32, 64))
    x = torch.randn(4, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = nf4_linear(x, packed, absmax, 64)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


def test_config_field_checks() -> None:
    LoRA(base_quantization="nf4").validate()
    with pytest.raises(ConfigError, match=r"base_quantization='int4' must be None or 'nf4'"):
        LoRA(base_quantization="int4").validate()
    with pytest.raises(NotSupportedError, match="DoRA"):
        DoRA(base_quantization="nf4").validate()


def _tiny_models():
    from longspan.models.gpt import build_gpt_model, init_weights
    from longspan.models.gpt_provider import GPTModelProvider
    from longspan.peft.adapters import init_adapters

    provider = GPTModelProvider(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                                num_query_groups=2, seq_length=32, vocab_size=96, normalization="RMSNorm",
                                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                                position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0)
    models = []
    for quantization in (None, "nf4"):
        model = build_gpt_model(provider, materialize=False)
        peft = LoRA(dim=4, alpha=8, base_quantization=quantization)
        peft.apply(model)
        init_weights(model, seed=7, device="cpu")
        init_adapters([model], 7)
        models.append((model.eval(), peft))
    return models


def test_nf4_model_logits_within_the_quantization_error() -> None:
    (full, _), (nf4, peft) = _tiny_models()
    full_weights = {n: m.weight.detach().clone() for n, m in nf4.named_modules() if hasattr(m, "adapter")}
    assert quantize_base_weights([nf4], peft) == len(full_weights) == 2 * 7
    assert all(isinstance(nf4.get_submodule(n), NF4LoRALinear) for n in full_weights)
    assert not any(n in dict(nf4.named_parameters()) for n in (f"{k}.weight" for k in full_weights))
    tokens = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference, quantized = full(tokens), nf4(tokens)
        # the NF4 forward is the forward of the dequantized weights
        for name in full_weights:
            full.get_submodule(name).weight.copy_(nf4.get_submodule(name).weight)
        assert torch.allclose(full(tokens), quantized, rtol=1e-5, atol=1e-5)
    relative = {n: ((nf4.get_submodule(n).weight - w).norm() / w.norm()).item() for n, w in full_weights.items()}
    in_series = 4 * 2  # (q|k|v -> proj) and (fc1|gate -> fc2) per layer, 2 layers
    bound = in_series * max(relative.values())
    change = ((quantized - reference).norm() / reference.norm()).item()
    print(f"\nNF4 relative weight error max {max(relative.values()):.4f}; logits relative change {change:.4f} "
          f"<= first-order bound {bound:.4f}")
    assert 0 < change <= bound


def test_planner_counts_nf4_base_at_half_a_byte_plus_scales() -> None:
    from longspan.planner import plan as planner
    from longspan.models.gpt import build_gpt_model
    from longspan.parallel.mesh import derive_layout
    from longspan.peft.nf4 import NF4_BYTES_PER_PARAM
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    cfg.model.vocab_size = 256
    meta = build_gpt_model(cfg.model, materialize=False)
    quantized = sum(m.weight.numel() for n, m in meta.named_modules()
                    if n.rpartition(".")[2] in ("linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1",
                                                "linear_fc1_gate", "linear_fc2"))
    memory, counts = {}, {}
    for quantization in (None, "nf4"):
        cfg.peft = LoRA(base_quantization=quantization)
        memory[quantization] = planner.estimate_memory(cfg, derive_layout(1), meta)
        counts[quantization] = planner.rank_parameter_counts(cfg, derive_layout(1), meta)[0]
        assert planner.model_parameter_counts(cfg, meta)["total"] == counts[None]["dense"]
    assert counts["nf4"]["nf4"] == quantized and counts["nf4"]["dense"] == counts[None]["dense"] - quantized
    # fp32 parameters: 4 bytes each become 0.5625; their gradients and Adam moments (4 + 8 bytes) go
    assert memory[None].weights - memory["nf4"].weights == pytest.approx(quantized * (4 - NF4_BYTES_PER_PARAM))
    assert memory[None].optimizer - memory["nf4"].optimizer == pytest.approx(quantized * 8)
