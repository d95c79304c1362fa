"""ConfigContainer.validate(): derived values against Megatron's formulas, cross-field rules, support table."""

from __future__ import annotations

import copy
import dataclasses
import signal
import warnings

import pytest
import torch

from longspan.config import inapplicable_fields
from longspan.recipes.loading import load_config
from longspan.config.support import DEVICE, HINT, NOT_SUPPORTED, SECTION_DEFAULT, field_status
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.recipes import get_recipe


def _tiny(*overrides: str):
    return load_config("tiny", [], list(overrides))


@pytest.mark.parametrize("world,tp,mbs,gbs", [(1, 1, 2, 16), (2, 1, 2, 16), (4, 2, 2, 16), (8, 2, 1, 32), (4, 4, 2, None)])
def test_data_parallel_size_and_microbatches(world: int, tp: int, mbs: int, gbs) -> None:
    cfg = _tiny(f"model.tensor_model_parallel_size={tp}", f"train.micro_batch_size={mbs}",
                f"train.global_batch_size={'null' if gbs is None else gbs}")
    cfg.validate(world_size=world)
    dp = world // tp  # world = tp * pp * cp * dp with pp = cp = 1
    expected_gbs = gbs if gbs is not None else mbs * dp
    assert cfg.data_parallel_size == dp == cfg.get_data_parallel_size(world)
    assert cfg.train.global_batch_size == expected_gbs
    assert cfg.num_microbatches == expected_gbs // (mbs * dp)


@pytest.mark.parametrize("train_iters,decay_iters,warmup_iters,fraction,wsd_iters", [
    (200, None, 0, 0.05, None), (100, 80, 10, None, None), (50, None, 5, None, 20), (30, 30, 0, None, None),
])
def test_iteration_based_scheduler_steps(train_iters, decay_iters, warmup_iters, fraction, wsd_iters) -> None:
    style = "WSD" if wsd_iters else "cosine"
    cfg = _tiny(f"train.train_iters={train_iters}", f"scheduler.lr_decay_iters={'null' if decay_iters is None else decay_iters}",
                f"scheduler.lr_warmup_iters={warmup_iters}",
                f"scheduler.lr_warmup_fraction={'null' if fraction is None else fraction}",
                f"scheduler.lr_wsd_decay_iters={'null' if wsd_iters is None else wsd_iters}",
                f"scheduler.lr_decay_style={style}")
    cfg.validate(world_size=1)
    gbs = cfg.train.global_batch_size
    # reference §3: decay = (lr_decay_iters or train_iters)·gbs; warmup = fraction·decay or warmup_iters·gbs;
    # wd_incr = train_iters·gbs; WSD decay = lr_wsd_decay_iters·gbs.
    decay = (decay_iters or train_iters) * gbs
    warmup = fraction * decay if fraction is not None else warmup_iters * gbs
    s = cfg.scheduler
    assert s.lr_decay_steps == decay
    assert s.lr_warmup_steps == warmup
    assert s.wd_incr_steps == train_iters * gbs
    assert s.wsd_decay_steps == (wsd_iters * gbs if wsd_iters else None)
    assert s.start_weight_decay == s.end_weight_decay == cfg.optimizer.weight_decay


def test_sample_based_scheduler_steps() -> None:
    cfg = _tiny("train.train_iters=null", "train.train_samples=12800", "scheduler.lr_warmup_fraction=null",
                "scheduler.lr_warmup_samples=640", "scheduler.lr_wsd_decay_samples=1000",
                "scheduler.lr_decay_samples=10000")
    cfg.validate(world_size=1)
    s = cfg.scheduler
    # Megatron-LM sample-based: decay = lr_decay_samples (or train_samples), warmup = lr_warmup_samples,
    # wd_incr = train_samples, WSD decay = lr_wsd_decay_samples.
    assert (s.lr_decay_steps, s.lr_warmup_steps, s.wd_incr_steps, s.wsd_decay_steps) == (10000, 640, 12800, 1000)
    cfg = _tiny("train.train_iters=null", "train.train_samples=12800")  # tiny's warmup fraction 0.05
    cfg.validate(world_size=1)
    assert cfg.scheduler.lr_decay_steps == 12800 and cfg.scheduler.lr_warmup_steps == 0.05 * 12800


def test_scheduler_values_are_accepted_by_megatron_core_scheduler() -> None:
    """Feed the derived values to megatron-core's OptimizerParamScheduler (test-only oracle)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class _Opt:  # the scheduler only touches param_groups
        param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    cfg = _tiny("scheduler.lr_warmup_fraction=null", "scheduler.lr_warmup_iters=10")
    cfg.validate(world_size=1)
    s, o = cfg.scheduler, cfg.optimizer
    sched = OptimizerParamScheduler(
        _Opt(), init_lr=s.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=s.lr_warmup_steps,
        lr_decay_steps=s.lr_decay_steps, lr_decay_style=s.lr_decay_style, start_wd=s.start_weight_decay,
        end_wd=s.end_weight_decay, wd_incr_steps=s.wd_incr_steps, wd_incr_style=s.weight_decay_incr_style,
        wsd_decay_steps=s.wsd_decay_steps, lr_wsd_decay_style=s.lr_wsd_decay_style,
    )
    gbs = cfg.train.global_batch_size
    sched.step(10 * gbs)  # end of warmup: the peak
    assert sched.get_lr(_Opt.param_groups[0]) == pytest.approx(o.lr)
    sched.step(190 * gbs)  # end of training: the floor
    assert sched.get_lr(_Opt.param_groups[0]) == pytest.approx(o.min_lr)


def test_warmup_longer_than_decay_is_rejected() -> None:
    """Megatron Core asserts warmup < decay; longspan says so in one line instead of capping silently."""
    cfg = _tiny("train.train_iters=8", "scheduler.lr_warmup_fraction=null", "scheduler.lr_warmup_iters=10")
    with pytest.raises(ConfigError, match=r"warmup \(10 iterations\) is not shorter than the decay \(8 iterations\)"):
        cfg.validate(world_size=1)
    cfg = _tiny("train.train_iters=8", "scheduler.lr_warmup_fraction=null", "scheduler.lr_warmup_iters=7")
    cfg.validate(world_size=1)
    assert cfg.scheduler.lr_warmup_steps == 7 * 16 < cfg.scheduler.lr_decay_steps


def test_resolved_defaults_and_idempotence() -> None:
    cfg = get_recipe("tiny")
    assert cfg.model.params_dtype is None and cfg.train.exit_signal is None  # construction never resolves
    cfg.validate(world_size=2)
    assert cfg.model.params_dtype is torch.float32 and cfg.model.pipeline_dtype is torch.float32
    assert cfg.train.exit_signal == signal.SIGTERM
    assert cfg.model.kv_channels == 128 // 8
    snapshot = copy.deepcopy(cfg)
    cfg.validate(world_size=2)
    assert cfg == snapshot and cfg.to_yaml() == snapshot.to_yaml()
    assert (cfg.data_parallel_size, cfg.num_microbatches) == (2, 4)


def test_world_size_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = _tiny()
    cfg.validate()
    assert cfg.data_parallel_size == 4 and cfg.num_microbatches == 2
    monkeypatch.delenv("WORLD_SIZE")
    cfg.validate()
    assert cfg.data_parallel_size == 1 and cfg.num_microbatches == 8


def test_mixed_precision_is_the_single_source_of_truth() -> None:
    cfg = _tiny("mixed_precision=bf16_mixed")
    cfg.validate(world_size=1)
    assert cfg.model.bf16 and cfg.optimizer.bf16 and not cfg.model.fp16
    assert cfg.model.params_dtype is torch.bfloat16 and cfg.optimizer.params_dtype is torch.bfloat16
    assert cfg.ddp.grad_reduce_in_fp32 is True
    cfg = _tiny("mixed_precision=fp16-mixed")
    cfg.validate(world_size=1)
    assert cfg.model.fp16 and cfg.optimizer.fp16 and cfg.model.params_dtype is torch.float16
    assert cfg.model.fp8_recipe == "delayed"  # fp8 knobs stay at their defaults without fp8
    cfg = _tiny("model.bf16=true", "optimizer.bf16=true")  # without mixed_precision: flags agree -> valid
    cfg.validate(world_size=1)
    assert cfg.model.params_dtype is torch.bfloat16


def test_distributed_optimizer_copied_to_ddp() -> None:
    cfg = _tiny("optimizer.use_distributed_optimizer=true")
    assert cfg.ddp.use_distributed_optimizer is False
    cfg.validate(world_size=2)
    assert cfg.ddp.use_distributed_optimizer is True


@pytest.mark.parametrize("overrides,world,match", [
    (["model.sequence_parallel=true"], 1, "sequence_parallel=True needs model.tensor_model_parallel_size > 1"),
    (["model.virtual_pipeline_model_parallel_size=2"], 1, "needs model.pipeline_model_parallel_size > 1"),
    (["model.pipeline_model_parallel_size=3", "model.virtual_pipeline_model_parallel_size=2"], 3, "num_layers=4 is not divisible"),
    (["checkpoint.ckpt_format=zarr"], 1, "checkpoint.ckpt_format='zarr' is not supported yet by longspan"),
    (["model.bf16=true", "model.fp16=true", "optimizer.bf16=true", "optimizer.fp16=true"], 1, "choose one"),
    (["model.bf16=true"], 1, "model.bf16=True but optimizer.bf16=False"),
    (["model.seq_length=128"], 1, "dataset.sequence_length=256 differs from model.seq_length=128"),
    (["model.tensor_model_parallel_size=3"], 3, "must divide model.num_attention_heads"),
    (["model.tensor_model_parallel_size=2"], 3, "world size 3 is not divisible"),
    (["train.global_batch_size=14"], 2, "global_batch_size=14 is not divisible"),
    (["train.train_iters=null"], 1, "give one of train.train_iters and train.train_samples"),
    (["ddp.use_distributed_optimizer=true"], 1, "optimizer.use_distributed_optimizer=False"),
    (["dataset.data_path=0.5 a 0.5"], 1, "dataset.data_path='0.5 a 0.5' is not valid"),
    (["dataset.split=9x,1"], 1, "dataset.split='9x,1' is not valid"),
    (["optimizer.lr=null"], 1, "optimizer.lr is required"),
    (["model.make_vocab_size_divisible_by=1", "model.vocab_size=4097", "model.tensor_model_parallel_size=2"], 2, "padded vocabulary 4097"),
])
def test_cross_field_rules(overrides, world, match) -> None:
    cfg = _tiny(*overrides)
    with pytest.raises(ConfigError, match=match):
        cfg.validate(world_size=world)


def test_decrease_batch_size_if_needed() -> None:
    cfg = _tiny("train.global_batch_size=20", "train.decrease_batch_size_if_needed=true")
    cfg.validate(world_size=2)
    assert cfg.num_microbatches == 20 // 4 and cfg.train.global_batch_size == 20


@pytest.mark.parametrize("override,world", [
    ("model.test_mode=true", 1),
    ("model.use_ring_exchange_p2p=true", 1),
    ("model.restore_modelopt_state=true", 1), ("checkpoint.non_persistent_ckpt_type=in_memory", 1),
    ("checkpoint.strict_fsdp_dtensor_load=true", 1), ("ddp.nccl_ub=true", 1),
])
def test_not_supported_fields_raise(override: str, world: int) -> None:
    cfg = _tiny(override)
    with pytest.raises(NotSupportedError) as err:
        cfg.validate(world_size=world)
    field, value = override.split("=")
    assert str(err.value).startswith(f"{field}=") and "is not supported yet by longspan (supported:" in str(err.value)


def test_t5_and_mamba_load_round_trip_and_validate(tmp_path) -> None:
    from longspan.models import MambaProvider, T5ModelProvider
    from longspan.training.config import ConfigContainer

    for provider in (T5ModelProvider(num_layers=4, hidden_size=128, num_attention_heads=8, seq_length=256),
                     MambaProvider(hidden_size=128, num_layers=4, num_attention_heads=8, seq_length=256,
                                   mamba_num_groups=2)):
        cfg = _tiny()
        cfg.model = provider
        text = cfg.to_yaml(str(tmp_path / "cfg.yaml"))
        assert ConfigContainer.from_yaml(str(tmp_path / "cfg.yaml")).model == provider
        cfg.validate(world_size=1)  # validate() runs the model rules too: 2 groups divide the 4 Mamba heads
        assert type(provider).__name__ in text


def test_support_table_covers_every_field_and_device_fields_are_reported() -> None:
    from longspan.config.targets import section_types

    statuses = set()
    for section, classes in section_types().items():
        assert section in SECTION_DEFAULT
        for cls in classes:
            for f in dataclasses.fields(cls):
                statuses.add(field_status(section, f.name))
    assert statuses == {"supported", NOT_SUPPORTED, DEVICE, HINT}
    # Defaults that adapt to the machine (pin_memory, nccl) are never reported; explicit settings are.
    assert inapplicable_fields(_tiny()) == []
    cfg = _tiny("train.empty_unused_memory_level=1", "dist.distributed_backend=gloo")
    found = inapplicable_fields(cfg)
    if torch.cuda.is_available():
        assert found == []
    else:
        assert found == ["train.empty_unused_memory_level=1"]
        cfg.validate(world_size=1)  # device-dependent fields never fail validation


def test_performance_hints_are_accepted_and_reported() -> None:
    cfg = _tiny("model.masked_softmax_fusion=true", "model.gradient_accumulation_fusion=true")
    cfg.validate(world_size=1)  # a Bridge config that turns fusions on still validates
    found = inapplicable_fields(cfg)
    assert "model.masked_softmax_fusion=True" in found and "model.gradient_accumulation_fusion=True" in found


def test_support_doc_is_current() -> None:
    from longspan.config.support_doc import main

    assert main(["--check"]) == 0, "docs/config-support.md is stale: run python -m longspan.config.support_doc"


def test_train_samples_derive_train_iters_like_megatron() -> None:
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    cfg.train.train_samples = 100  # gbs 16: 100 // 16 = 6 iterations
    cfg.validate(world_size=1)
    assert cfg.train.train_iters == 6
    cfg.validate(world_size=1)  # idempotent
    assert cfg.train.train_iters == 6

    cfg.train.rampup_batch_size = [4, 4, 32]  # 4, 8 (at 8 samples: 4 + 4*int(4/(32/3))...) walked by hand below
    cfg.validate(world_size=1)
    per_increment = 32 / ((16 - 4) // 4)
    consumed = iterations = 0
    while consumed <= 32 and consumed <= 100:
        consumed += 4 + 4 * int(consumed / per_increment)
        iterations += 1
    assert cfg.train.train_iters == iterations + (100 - consumed) // 16
