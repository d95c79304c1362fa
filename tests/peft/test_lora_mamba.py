"""LoRA / DoRA / CanonicalLoRA on the Mamba-2 mixers of a hybrid (``M*-M``): the mixer's projections go by
Megatron's ``in_proj`` (one shared A over its z/x/B/C/dt segments) and ``out_proj``, as Megatron Bridge's
Nemotron-H and Nemotron 3 LoRA recipes target them; the adapters reach the mixer's forward (which computes with
local tensors), its token-by-token generation, train alone, fold into the merged weights exactly, and split with
their base weights under tensor (+ sequence) and context parallel (every gradient as one process's)."""

from __future__ import annotations

import pytest
import torch

from longspan.core.errors import ConfigError
from longspan.models.init import init_weights
from longspan.models.mamba import MambaMixer, build_mamba_model
from longspan.peft import CanonicalLoRA, DoRA, LoRA
from longspan.peft.adapters import init_adapters, init_dora_magnitudes, merged_state_dict, plan_adapters
from longspan.peft.modules import DoRALinear, LoRALinear
from tests.helpers.adapters import assert_adapters_act_and_fold, perturb_adapters, trained_parameters
from tests.models.mamba.mamba_test_config import hybrid_config
from tests.parallel.harness import get_shared_pool

SEED, VOCAB, SEQ = 5, 128, 16
BRIDGE_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj"]
SEGMENTS = ("z", "x", "B", "C", "dt")
MIXER = "decoder.layers.0.mixer"


def _provider(**layout):
    # 8 Mamba heads in 2 groups (tp2 x cp2 split them), 4 attention heads in 2 query groups
    return hybrid_config(vocab_size=VOCAB, seq_length=SEQ, **layout)


def _model(peft=None, seed: int = SEED, **layout):
    model = build_mamba_model(_provider(**layout), materialize=False)
    if peft is not None:
        peft.apply(model)
    init_weights(model, seed=seed, device="cpu")
    if peft is not None:
        init_adapters([model], seed)
        init_dora_magnitudes([model])
    return model


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))


def test_megatron_and_canonical_names_of_the_mixer_projections() -> None:
    model = build_mamba_model(_provider(), materialize=False)
    groups = plan_adapters(model, LoRA(target_modules=BRIDGE_TARGETS))
    assert groups[f"{MIXER}.in_proj"] == [f"{MIXER}.in_proj.{s}" for s in SEGMENTS]
    assert groups[f"{MIXER}.out_proj"] == [f"{MIXER}.out_proj"]
    assert "decoder.layers.3.mixer.in_proj" in groups and "decoder.layers.1.self_attention.linear_qkv" in groups
    mamba_only = plan_adapters(model, LoRA(target_modules=["in_proj", "out_proj"]))
    assert sorted(mamba_only) == sorted(f"decoder.layers.{i}.mixer.{p}" for i in (0, 3) for p in ("in_proj", "out_proj"))
    # Megatron's default targets (attention and MLP) leave the mixers alone
    assert not any(".mixer." in g for g in plan_adapters(model, LoRA()))
    canonical = plan_adapters(model, CanonicalLoRA(target_modules=["in_proj_dt", "in_proj_B", "out_proj"]))
    assert sorted(canonical) == sorted(f"decoder.layers.{i}.mixer.{p}" for i in (0, 3)
                                       for p in ("in_proj_dt", "in_proj_B", "out_proj"))
    # Bridge's CanonicalLoRA takes the fused in_proj whole (one shared A), as LoRA does
    fused = plan_adapters(model, CanonicalLoRA(target_modules=["linear_q", "in_proj", "out_proj"]))
    assert fused[f"{MIXER}.in_proj"] == [f"{MIXER}.in_proj.{s}" for s in SEGMENTS]
    assert "decoder.layers.1.self_attention.linear_q" in fused and f"{MIXER}.out_proj" in fused
    split = plan_adapters(model, CanonicalLoRA(target_modules=["in_proj", "in_proj_dt"],
                                               exclude_modules=["*.in_proj_x"]))
    assert split[f"{MIXER}.in_proj_dt"] == [f"{MIXER}.in_proj.dt"]  # the split name wins where it matches
    assert split[f"{MIXER}.in_proj"] == [f"{MIXER}.in_proj.{s}" for s in ("z", "B", "C")]  # x excluded
    exclude = plan_adapters(model, LoRA(target_modules=[], exclude_modules=["*.mixer.in_proj"]))
    assert f"{MIXER}.out_proj" in exclude and f"{MIXER}.in_proj" not in exclude
    with pytest.raises(ConfigError, match="in_proj_dt"):
        plan_adapters(model, CanonicalLoRA(target_modules=["in_proj_xBC"]))


@pytest.mark.parametrize("peft", [LoRA(dim=4, alpha=8), DoRA(dim=4, alpha=8), CanonicalLoRA(dim=4, alpha=8)],
                         ids=lambda p: type(p).__name__)
def test_mixer_adapters_act_and_fold_into_the_merged_weights(peft) -> None:
    peft.target_modules = ([f"in_proj_{s}" for s in SEGMENTS] + ["out_proj", "linear_q", "linear_fc2"]
                           if peft.kind == "canonical" else list(BRIDGE_TARGETS))
    ids = _ids()
    base = _model().eval()
    model = _model(peft).eval()
    mixer = model.decoder.layers["0"].mixer
    assert isinstance(mixer, MambaMixer)
    wrapper = DoRALinear if peft.kind == "dora" else LoRALinear
    assert all(isinstance(mixer.in_proj[s], wrapper) for s in SEGMENTS) and isinstance(mixer.out_proj, wrapper)
    assert_adapters_act_and_fold(model, base, _model().eval(), ids,
                                 [*(mixer.in_proj[s] for s in SEGMENTS), mixer.out_proj])


def test_generation_steps_through_the_adapted_mixer() -> None:
    """Decoding token by token (the mixer's recurrent form, cached) gives the logits of the merged model's."""
    from longspan.data.tokenizers import NullTokenizer
    from longspan.inference.text_generation import generate

    model = _model(LoRA(dim=4, alpha=8, target_modules=["in_proj", "out_proj"])).eval()
    perturb_adapters(model, std=0.5)
    merged = _model().eval()
    merged.load_state_dict(merged_state_dict(model))
    tokenizer, prompt = NullTokenizer(VOCAB - 1), [5, 17, 3, 99, 42]

    def run(m):
        return generate(m, tokenizer, prompt, max_new_tokens=6, use_cache=True, return_logits=True, eos_ids=())

    adapted, folded, plain = run(model), run(merged), run(_model().eval())
    assert adapted.output_ids == folded.output_ids
    for a, b in zip(adapted.logits, folded.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(adapted.logits, plain.logits))


def test_only_the_mixer_adapters_train_and_get_gradients() -> None:
    model = _model(LoRA(dim=4, alpha=8, target_modules=["in_proj", "out_proj"]))
    trainable = trained_parameters(model, _ids(1))
    assert all(".adapter." in n and ".mixer." in n for n in trainable)
    # one A for the five input segments of a mixer, a B each; out_proj its own A and B
    assert sum(".layers.0.mixer.in_proj." in n and "linear_in" in n for n in trainable) == 1
    assert sum(".layers.0.mixer.in_proj." in n and "linear_out" in n for n in trainable) == 5


# ------------------------------------------------------------------ layouts, model level, 2 processes

def _dora() -> DoRA:
    # B drawn non-zero so every factor's gradient is non-trivial; both kinds of projection and attention
    return DoRA(dim=4, alpha=1, lora_B_init_method="normal", target_modules=list(BRIDGE_TARGETS))


def _gradients(layout: dict) -> dict:
    """The loss of one uneven-masked batch and every adapter's full gradient on this process's layout, with the
    placements of the first mixer's adapter factors."""
    from torch.distributed.tensor import DTensor

    from longspan.parallel.init import initialize_distributed
    from longspan.parallel.parallelize import parallel_loss_context, parallelize_model
    from longspan.training.config import ConfigContainer, DistributedInitConfig

    provider = _provider(**layout)
    model = build_mamba_model(provider, materialize=False)
    _dora().apply(model)
    if layout:
        cfg = ConfigContainer(model=provider, dist=DistributedInitConfig(distributed_backend="gloo",
                                                                         distributed_timeout_minutes=1))
        parallel = initialize_distributed(cfg.dist, provider, device="cpu")
        model = parallelize_model(model, cfg, parallel)
    init_weights(model, seed=SEED, device="cpu")
    init_adapters([model], SEED)
    init_dora_magnitudes([model])
    g = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = (torch.rand(2, SEQ, generator=g) < 0.7).float()
    with parallel_loss_context(model):
        loss = (model(ids, labels=labels) * mask).sum() / mask.sum()
        loss.backward()
    inner = getattr(model, "module", model)
    grads = {}
    for name, p in inner.named_parameters():
        if p.requires_grad:
            grads[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    cp = layout.get("context_parallel_size", 1)
    if cp > 1:  # each cp rank holds cp x its tokens' share (the layout's reduction averages): average over cp
        import torch.distributed as dist

        for grad in grads.values():
            dist.all_reduce(grad)
            grad /= cp
    mixer = inner.decoder.layers["0"].mixer
    placements = {n: str(tuple(getattr(p, "placements", ()))) for n, p in mixer.named_parameters() if ".adapter." in n}
    return {"loss": float(loss.detach()), "grads": grads, "placements": placements}


LAYOUTS = {"tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
           "cp2": dict(context_parallel_size=2)}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_adapters_split_with_the_mixer_and_train_as_one_process(name: str) -> None:
    want = _gradients({})
    # per mixer: in_proj one A, five B and five magnitudes; out_proj A, B, magnitude
    assert sum(".mixer." in k for k in want["grads"]) == 2 * (1 + 5 + 5 + 3)
    for rank, got in enumerate(get_shared_pool(2).run(_gradients, LAYOUTS[name], timeout=100)):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), rank
        p = got["placements"]
        if name == "tp2_sp":  # in_proj's A whole, its B and magnitudes by heads; out_proj's A by heads
            assert p["in_proj.z.adapter.linear_in.weight"] == p["out_proj.adapter.linear_out.weight"] == \
                p["out_proj.adapter.weight_magnitude"] == "(Replicate(),)", p
            assert p["in_proj.dt.adapter.linear_out.weight"] == p["in_proj.B.adapter.weight_magnitude"] == \
                "(Shard(dim=0),)" and p["out_proj.adapter.linear_in.weight"] == "(Shard(dim=1),)", p
        assert sorted(got["grads"]) == sorted(want["grads"])
        for key, grad in got["grads"].items():
            torch.testing.assert_close(grad, want["grads"][key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
