"""Muon (optimizer.optimizer='muon', longspan.training.optim.muon): one step of each weight matrix equals a
Newton-Schulz orthogonalisation written out here (the gated MLP's gate and up projections as one matrix, as
Megatron fuses them), the other parameters step exactly as torch's AdamW; the muon_* fields change the update
as documented; a resume with dropout on is bit-exact; settings Muon cannot run are one-line errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from longspan.config.schema.optim import OptimizerConfig
from longspan.core.errors import ConfigError
from longspan.training.optim.optimizer import get_megatron_optimizer
from tests.training.pretrain_helpers import losses_by_iteration, tiniest_config

LR, WD, MU = 0.05, 0.1, 0.9

# Megatron's 'quintic' coefficient sets (Emerging-Optimizers' muon_utils), one per Newton-Schulz step.
COEFFICIENTS = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


def reference_orthogonalisation(m: torch.Tensor, steps: int = 5, bf16: bool = False) -> torch.Tensor:
    """Newton-Schulz on the wide orientation of ``m`` from unit Frobenius norm, float64 unless ``bf16``."""
    tall = m.shape[0] > m.shape[1]
    x = (m.T if tall else m).double()
    x = x / x.norm()
    if bf16:
        x = x.bfloat16()
    for i in range(steps):
        a, b, c = COEFFICIENTS[i % 5]
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.double()
    return x.T if tall else x


class Block(nn.Module):
    """Names the optimizer reads: a gated MLP (gate + up fused for Muon), a norm with a bias, an embedding."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.mlp = nn.Module()
        self.mlp.linear_fc1_gate = nn.Linear(6, 4, bias=False)
        self.mlp.linear_fc1 = nn.Linear(6, 4, bias=False)
        self.mlp.linear_fc2 = nn.Linear(4, 6, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def _grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _config(**fields) -> OptimizerConfig:
    cfg = OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WD, clip_grad=0.0, muon_momentum=MU,
                          muon_fp32_matmul_prec="highest", adam_beta2=0.95)
    for name, value in fields.items():
        setattr(cfg, name, value)
    return cfg


def test_one_step_is_the_reference_newton_schulz_on_matrices_and_adamw_on_the_rest() -> None:
    model = Block()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adamw_model = copy.deepcopy(model)
    opt = get_megatron_optimizer(_config(), [model])
    _grads(model, 1)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()

    def expected(names: list[str]) -> list[torch.Tensor]:
        fused = torch.cat([grads[n] for n in names])  # first momentum: (1 - mu) * grad, gone in the normalisation
        update = reference_orthogonalisation(fused) * math.sqrt(max(fused.shape))  # 'spectral' scale
        return [before[n].double() * (1 - LR * WD) - LR * u
                for n, u in zip(names, torch.split(update, [grads[n].shape[0] for n in names]))]

    for names in (["mlp.linear_fc1_gate.weight", "mlp.linear_fc1.weight"], ["mlp.linear_fc2.weight"]):
        for name, want in zip(names, expected(names)):
            got = dict(model.named_parameters())[name].double()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    # Every other parameter: torch's AdamW, with Megatron's groups (no decay on the norm's weight and bias)
    other = ["embedding.word_embeddings.weight", "norm.weight", "norm.bias"]
    params = dict(adamw_model.named_parameters())
    reference = torch.optim.AdamW([{"params": [params[other[0]]], "weight_decay": WD},
                                   {"params": [params[n] for n in other[1:]], "weight_decay": 0.0}],
                                  lr=LR, betas=(0.9, 0.95), eps=1e-8)
    for n in other:
        params[n].grad = grads[n]
    reference.step()
    for n in other:
        assert torch.equal(dict(model.named_parameters())[n], params[n]), n
    assert set(opt.state[dict(model.named_parameters())["mlp.linear_fc2.weight"]]) == {"momentum_buffer"}


def test_muon_takes_weight_matrices_and_expert_stacks_only() -> None:
    from longspan.training.optim.muon import is_muon_matrix

    def takes(name: str, *shape: int, embedding: bool = False) -> bool:
        return is_muon_matrix(name, nn.Parameter(torch.empty(shape)), embedding)

    assert takes("decoder.layers.0.mlp.router.weight", 4, 8)
    assert takes("decoder.layers.0.mlp.experts.linear_fc1.weight", 4, 16, 8)
    assert not takes("decoder.layers.0.mlp.experts.linear_fc1.bias", 4, 16)  # one bias vector per expert
    assert not takes("embedding.word_embeddings.weight", 64, 8, embedding=True)
    assert not takes("decoder.layers.0.mixer.conv1d.x.weight", 16, 1, 4)
    assert not takes("decoder.layers.0.input_layernorm.weight", 8)


def _two_steps(**fields) -> dict[str, torch.Tensor]:
    model = Block()
    opt = get_megatron_optimizer(_config(**fields), [model])
    for seed in (1, 2):
        _grads(model, seed)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_muon_fields_change_the_update_as_documented() -> None:
    base = _two_steps()
    fc2 = "mlp.linear_fc2.weight"
    # muon_extra_scale_factor and muon_scale_mode only scale the orthogonalised update
    scaled = _two_steps(muon_extra_scale_factor=0.2)
    rms = _two_steps(muon_scale_mode="unit_rms_norm")  # fc2 is 6 x 4: sqrt(6 / 4) instead of sqrt(6)
    start = Block().state_dict()[fc2] * (1 - LR * WD) ** 2  # what the weight decay alone leaves
    for params, factor in ((scaled, 0.2), (rms, 0.5)):
        torch.testing.assert_close(params[fc2] - start, (base[fc2] - start) * factor, rtol=1e-5, atol=1e-6)
    # Nesterov, the momentum, bf16 iterations, ten steps and split q/k/v each give another update
    for fields in ({"muon_use_nesterov": True}, {"muon_momentum": 0.5}, {"muon_fp32_matmul_prec": "medium"},
                   {"muon_num_ns_steps": 10}):
        assert not torch.equal(_two_steps(**fields)[fc2], base[fc2]), fields
    # AdamW's part follows adam_* and not the muon_* fields
    assert torch.equal(_two_steps(muon_momentum=0.5)["norm.weight"], base["norm.weight"])
    assert not torch.equal(_two_steps(adam_beta1=0.5)["norm.weight"], base["norm.weight"])


def test_split_qkv_false_orthogonalises_query_key_value_as_one_matrix() -> None:
    from longspan.training.optim.muon import fused_matrix_key

    names = [f"decoder.layers.3.self_attention.linear_{x}.weight" for x in "qkv"]
    assert len({fused_matrix_key(n, True)[0] for n in names}) == 3
    assert [fused_matrix_key(n, False) for n in names] == [("decoder.layers.3.self_attention.qkv", i) for i in range(3)]
    segments = [fused_matrix_key(f"decoder.layers.0.mixer.in_proj.{s}.weight", True) for s in ("z", "x", "B", "C", "dt")]
    assert [order for _, order in segments] == list(range(5)) and len({key for key, _ in segments}) == 1
    assert fused_matrix_key("decoder.layers.0.mixer.conv1d.x.weight", True)[1] == 0


def _run(tmp_path, name: str):
    cfg = tiniest_config(tmp_path, name, train_iters=4)
    cfg.optimizer.optimizer = "muon"
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.1
    return cfg


def test_resume_is_bit_exact_with_dropout(tmp_path) -> None:
    from longspan.training.pretrain import pretrain

    straight = _run(tmp_path, "straight")
    straight.checkpoint.save_interval = 2
    pretrain(straight)
    want = losses_by_iteration(straight)
    assert sorted(want) == [1, 2, 3, 4]
    resumed = _run(tmp_path, "resumed")
    resumed.checkpoint.load, resumed.checkpoint.ckpt_step, resumed.checkpoint.save = straight.checkpoint.save, 2, None
    pretrain(resumed)
    got = losses_by_iteration(resumed)
    assert sorted(got) == [3, 4] and all(got[it] == want[it] for it in (3, 4))


@pytest.mark.parametrize("fields, message", [
    ({"muon_num_ns_steps": 3}, "optimizer.muon_num_ns_steps=3 is invalid: .* positive multiple of 5"),
    ({"muon_tp_mode": "distributed"}, "optimizer.muon_tp_mode='distributed' is not supported yet"),
    ({"optimizer": "dist_muon"}, "optimizer.optimizer='dist_muon' .* is not supported yet"),
    ({"optimizer": "adam", "muon_momentum": 0.9}, "optimizer.muon_momentum=0.9 applies to optimizer.optimizer='muon'"),
    ({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5},
     "optimizer.optimizer_cpu_offload=True is not supported yet with optimizer.optimizer='muon'"),
    ({"muon_momentum": 1.0}, "optimizer.muon_momentum=1.0 is out of range"),
], ids=["ns-steps", "tp-distributed", "dist-muon", "muon-field-with-adam", "cpu-offload", "momentum-1"])
def test_what_muon_cannot_run_is_a_one_line_error(tmp_path, fields, message) -> None:
    cfg = tiniest_config(tmp_path, train_iters=2)
    cfg.optimizer.optimizer = "muon"
    for name, value in fields.items():
        setattr(cfg.optimizer, name, value)
    with pytest.raises(ConfigError, match=message) as error:
        cfg.validate(world_size=1)
    assert "\n" not in str(error.value)
