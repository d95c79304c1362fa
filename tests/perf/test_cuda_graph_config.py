"""model.enable_cuda_graph / cuda_graph_warmup_steps / external_cuda_graph (device-dependent): the config rules,
the wiring into the compiled layers (torch.compile mode='reduce-overhead' on CUDA only) and the per-layer
warmup forwards, all checked on a CPU; the capture itself needs CUDA."""

from __future__ import annotations

import pytest
import torch

from longspan.recipes.loading import load_config
from longspan.config import support
from longspan.core.errors import ConfigError
from longspan.parallel import compile as compile_mod


@pytest.mark.parametrize("overrides, needle", [
    (["model.enable_cuda_graph=true", "model.external_cuda_graph=true"], "cannot be set together"),
    (["model.enable_cuda_graph=true", "train.torch_compile=false"], "set train.torch_compile=true or null"),
    (["model.external_cuda_graph=true", "model.cpu_offloading=true", "model.cpu_offloading_num_layers=1"],
     "cannot be captured"),
    (["model.cuda_graph_warmup_steps=5"], "read only with model.enable_cuda_graph=True"),
    (["model.enable_cuda_graph=true", "model.recompute_granularity=full", "model.recompute_method=uniform",
      "model.recompute_num_layers=1"], "per-layer graphs cannot"),
    (["model.enable_cuda_graph=true", "model.cuda_graph_warmup_steps=-1"], "integer >= 0"),
])
def test_cuda_graph_rules(overrides, needle):
    cfg = load_config("tiny", [], overrides)
    with pytest.raises(ConfigError, match=needle) as err:
        cfg.validate(world_size=1)
    assert "\n" not in str(err.value)


def test_valid_cuda_graph_config_is_listed_as_not_applicable_without_an_accelerator(monkeypatch):
    cfg = load_config("tiny", [], ["model.enable_cuda_graph=true", "model.cuda_graph_warmup_steps=2"])
    cfg.validate(world_size=1)
    monkeypatch.setattr(support, "_has_accelerator", lambda: False)
    assert support.inapplicable_fields(cfg) == ["model.enable_cuda_graph=True"]
    assert compile_mod.cuda_graph_warmup(cfg.model, torch.device("cpu")) is None
    assert compile_mod.cuda_graph_warmup(cfg.model, torch.device("cuda", 0)) == 2


def test_layers_compile_in_reduce_overhead_mode_on_cuda_only(monkeypatch):
    from longspan.models.gpt import build_gpt_model

    cfg = load_config("tiny", [], ["model.num_layers=2"])
    modes = []

    def fake_compile(fn, mode=None):
        modes.append(mode)
        return fn

    monkeypatch.setattr(compile_mod.torch, "compile", fake_compile)
    monkeypatch.setattr(compile_mod, "compile_unavailable_reason", lambda device: None)
    for device, warmup in [(torch.device("cpu"), 2), (torch.device("cuda", 0), 2), (torch.device("cuda", 0), None)]:
        model = build_gpt_model(cfg.model, seed=0, device="cpu")
        assert compile_mod.compile_model([model], True, device, 1, warmup)
    assert modes == [None, None, "reduce-overhead", "reduce-overhead", None, None]


def test_each_layer_runs_its_warmup_forwards_eager_before_the_graphed_one():
    calls = []
    forward = compile_mod.cuda_graph_warmup_forwards(lambda x: calls.append("graphed"), lambda x: calls.append("eager"), 2)
    with torch.no_grad():
        forward(0)  # evaluation does not count as warmup
    for _ in range(4):
        forward(0)
    assert calls == ["graphed", "eager", "eager", "graphed", "graphed"]
