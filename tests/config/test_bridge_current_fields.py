"""Megatron Bridge's current names: its tutorial and example YAMLs (copied unchanged into fixtures/bridge_0_7_0,
each with its source URL) load, ``dist.use_megatron_fsdp`` is Megatron-FSDP as ``ddp.use_megatron_fsdp`` is,
every field Bridge's DistributedInitConfig / LoggerConfig / CheckpointConfig added since the spec is a field here
(with a status), and the straggler detector's numbers are range-checked like every other interval."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from longspan.config.support import NOT_SUPPORTED, field_status, not_supported_reason
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.recipes.loading import load_config
from longspan.training.config import CheckpointConfig, DistributedInitConfig, LoggerConfig

FIXTURES = Path(__file__).parent / "fixtures" / "bridge_0_7_0"

# Fields of Bridge 0.7.0's classes (with Megatron-LM's bases) that the spec's pages do not list.
NEWER_FIELDS = {
    "dist": (DistributedInitConfig, """use_megatron_fsdp lazy_mpu_init sharp_enabled_group
        distributed_timeout_seconds_after_init flight_recorder_dump_path flight_recorder_trace_buffer_size
        flight_recorder_dump_on_timeout flight_recorder_include_stack_trace flight_recorder_include_only_active
        flight_recorder_extra_dump_on_exec disable_jit_fuser use_decentralized_pg eval_context_parallel_size"""),
    "logger": (LoggerConfig, """log_memory_interval log_device_memory_used log_num_zeros_in_grad
        log_max_attention_logit barrier_with_L1_time mlflow_description mlflow_log_artifacts moe_routing_trace_path
        moe_routing_trace_max_training_iters moe_routing_trace_capture_logits moe_routing_trace_capture_hidden_states
        moe_routing_trace_dump_weights"""),
    "checkpoint": (CheckpointConfig, """save_params_interval save_activations_interval save_tokens_per_expert_interval
        save_wgrads_interval save_dgrads_interval save_retain_interval use_mp_args_from_checkpoint_args
        use_tokenizer_model_from_checkpoint_args auto_detect_ckpt_format ckpt_convert_update_legacy_dist_opt_format
        async_ckpt_cpu_priority async_ckpt_io_priority async_ckpt_use_cpu_shm async_write_results_mp_mode
        ckpt_fully_parallel_load_exchange_algo ckpt_fully_parallel_load_per_rank_objects
        ckpt_fully_parallel_save_process_group ckpt_fully_parallel_load_process_group ckpt_pg_tensors_cache_path
        ckpt_pg_tensors_cache_create ckpt_load_validate_sharding_integrity dist_ckpt_save_pre_mcore_014
        verify_integrity custom_manager_class dist_ckpt_workers hf_source_path hf_trust_remote_code
        hf_distributed_save hf_save_every_n_ranks"""),
}


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.yaml")))
def test_bridge_yamls_load_unchanged(name: str) -> None:
    cfg = load_config("tiny", [str(FIXTURES / name)], [])
    assert cfg.train.train_iters in (20, 100, 600)  # the file's value, not the recipe's
    assert cfg.dist.use_megatron_fsdp is False and cfg.dist.use_torch_fsdp2 is False


def test_the_tutorial_finetune_yaml_keeps_its_values() -> None:
    cfg = load_config("tiny", [str(FIXTURES / "llama32_1b_finetune.yaml")], [])
    assert (cfg.dataset.seq_length, cfg.model.seq_length) == (4096, 4096)
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.optimizer.lr) == (128, 2, 0.0001)
    assert (cfg.peft.dim, cfg.peft.alpha, cfg.checkpoint.save_interval) == (8, 16, 50)


def test_dist_use_megatron_fsdp_from_a_bridge_yaml_validates(tmp_path: Path) -> None:
    text = (FIXTURES / "qwen25_vl_pretrain_override_example.yaml").read_text()
    on = tmp_path / "fsdp.yaml"
    on.write_text(text.replace("use_megatron_fsdp: false", "use_megatron_fsdp: true"))
    cfg = load_config("tiny", [str(on)], ["model.seq_length=64", "dataset.seq_length=64",
                                           "train.global_batch_size=2", "train.micro_batch_size=1",
                                           "scheduler.lr_warmup_fraction=null"])  # the recipe's; the file sets iters
    cfg.validate(world_size=2)
    assert cfg.ddp.use_megatron_fsdp and cfg.optimizer.use_distributed_optimizer


@pytest.mark.parametrize("section", sorted(NEWER_FIELDS))
def test_every_newer_bridge_field_is_a_field_with_a_status(section: str) -> None:
    cls, names = NEWER_FIELDS[section]
    ours = {f.name for f in dataclasses.fields(cls)}
    for name in names.split():
        assert name in ours, f"{section}.{name}"
        if field_status(section, name) == NOT_SUPPORTED:
            assert not_supported_reason(section, name), f"{section}.{name} has no reason"


def test_a_newer_field_set_to_what_longspan_does_not_do_is_one_line() -> None:
    cfg = load_config("tiny", [], ["checkpoint.verify_integrity=true"])
    with pytest.raises(NotSupportedError, match=r"checkpoint.verify_integrity=True .*not hashed") as err:
        cfg.validate(world_size=1)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("override, message", [
    ("nvrx_straggler.report_time_interval=-1", r"nvrx_straggler.report_time_interval=-1(\.0)? is out of range: use a number >= 0"),
    ("nvrx_straggler.gpu_relative_perf_threshold=1.5", r"gpu_relative_perf_threshold=1.5 is out of range"),
    ("nvrx_straggler.num_gpu_perf_scores_to_print=-2", r"num_gpu_perf_scores_to_print=-2 is out of range"),
    ("straggler.straggler_minmax_count=0", r"straggler.straggler_minmax_count=0 is out of range"),
])
def test_straggler_numbers_out_of_range_are_one_line(override: str, message: str) -> None:
    section = override.split(".")[0]
    enable = "nvrx_straggler.enabled=true" if section == "nvrx_straggler" else "straggler.log_straggler=true"
    cfg = load_config("tiny", [], [enable, override])
    with pytest.raises(ConfigError, match=message) as err:
        cfg.validate(world_size=1)
    assert "\n" not in str(err.value)
