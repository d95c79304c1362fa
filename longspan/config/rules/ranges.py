"""Numeric bounds of config fields: one table (``RANGE_RULES``) checked by ``check_ranges``.

Part of ``ConfigContainer.validate()`` (``validate.py``); every failure is one ``ConfigError`` line.
"""

from __future__ import annotations

import math
import signal
from typing import TYPE_CHECKING, Optional

from longspan.core.errors import ConfigError

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer


# --- Ranges: one table for every numeric field with a bound ------------------------------------------------
# (field, kind, low, high, inclusive-low, inclusive-high); None for low/high is unbounded; a field whose
# value is None (optional, "derive it") is skipped, and a field a section does not have is skipped too.
INT, REAL = "an integer", "a number"


RANGE_RULES: tuple[tuple[str, str, Optional[float], Optional[float], bool, bool], ...] = (
    ("model.num_layers", INT, 1, None, True, True),
    ("model.hidden_size", INT, 1, None, True, True),
    ("model.num_attention_heads", INT, 1, None, True, True),
    ("model.num_query_groups", INT, 1, None, True, True),
    ("model.ffn_hidden_size", INT, 1, None, True, True),
    ("model.kv_channels", INT, 1, None, True, True),
    ("model.seq_length", INT, 1, None, True, True),
    ("model.vocab_size", INT, 1, None, True, True),
    ("model.make_vocab_size_divisible_by", INT, 1, None, True, True),
    ("model.layernorm_epsilon", REAL, 0, None, False, True),
    ("model.init_method_std", REAL, 0, None, True, True),
    ("model.embedding_init_method_std", REAL, 0, None, True, True),
    ("model.softmax_scale", REAL, 0, None, False, True),
    ("model.hidden_dropout", REAL, 0, 1, True, True),
    ("model.attention_dropout", REAL, 0, 1, True, True),
    ("model.rotary_percent", REAL, 0, 1, False, True),
    ("model.rope_scaling_factor", REAL, 0, None, False, True),
    ("model.recompute_num_layers", INT, 1, None, True, True),
    ("model.num_moe_experts", INT, 1, None, True, True),
    ("model.moe_router_topk", INT, 1, None, True, True),
    ("model.moe_ffn_hidden_size", INT, 1, None, True, True),
    ("model.moe_aux_loss_coeff", REAL, 0, None, True, True),
    ("model.moe_z_loss_coeff", REAL, 0, None, True, True),
    ("model.moe_expert_capacity_factor", REAL, 0, None, False, True),
    ("model.expert_tensor_parallel_size", INT, 1, None, True, True),
    ("model.num_layers_in_first_pipeline_stage", INT, 0, None, True, True),
    ("model.num_layers_in_last_pipeline_stage", INT, 0, None, True, True),
    ("train.micro_batch_size", INT, 1, None, True, True),
    ("train.global_batch_size", INT, 1, None, True, True),
    ("train.train_iters", INT, 0, None, True, True),
    ("train.train_samples", INT, 0, None, True, True),
    ("train.eval_iters", INT, 0, None, True, True),
    ("train.eval_interval", INT, 1, None, True, True),
    ("train.exit_interval", INT, 1, None, True, True),
    ("train.exit_duration_in_mins", REAL, 0, None, False, True),
    ("train.manual_gc_interval", INT, 0, None, True, True),
    ("train.check_weight_hash_across_dp_replicas_interval", INT, 1, None, True, True),
    ("train.train_sync_interval", INT, 1, None, True, True),
    ("train.empty_unused_memory_level", INT, 0, 2, True, True),
    ("optimizer.lr", REAL, 0, None, True, True),
    ("optimizer.min_lr", REAL, 0, None, True, True),
    ("optimizer.finetune_lr", REAL, 0, None, True, True),
    ("optimizer.decoupled_lr", REAL, 0, None, True, True),
    ("optimizer.decoupled_min_lr", REAL, 0, None, True, True),
    ("optimizer.weight_decay", REAL, 0, None, True, True),
    ("optimizer.adam_beta1", REAL, 0, 1, True, False),
    ("optimizer.adam_beta2", REAL, 0, 1, True, False),
    ("optimizer.adam_eps", REAL, 0, None, False, True),
    ("optimizer.sgd_momentum", REAL, 0, 1, True, True),
    ("optimizer.muon_momentum", REAL, 0, 1, True, False),
    ("optimizer.muon_num_ns_steps", INT, 1, None, True, True),
    ("optimizer.muon_extra_scale_factor", REAL, 0, None, False, True),
    ("optimizer.clip_grad", REAL, 0, None, True, True),
    ("optimizer.loss_scale", REAL, 0, None, False, True),
    ("optimizer.initial_loss_scale", REAL, 0, None, False, True),
    ("optimizer.min_loss_scale", REAL, 0, None, False, True),
    ("optimizer.loss_scale_window", REAL, 1, None, True, True),
    ("optimizer.hysteresis", INT, 1, None, True, True),
    ("scheduler.lr_warmup_iters", INT, 0, None, True, True),
    ("scheduler.lr_warmup_samples", INT, 0, None, True, True),
    ("scheduler.lr_decay_iters", INT, 1, None, True, True),
    ("scheduler.lr_decay_samples", INT, 1, None, True, True),
    ("scheduler.lr_wsd_decay_iters", INT, 1, None, True, True),
    ("scheduler.lr_wsd_decay_samples", INT, 1, None, True, True),
    ("scheduler.lr_warmup_fraction", REAL, 0, 1, True, True),
    ("scheduler.lr_warmup_init", REAL, 0, None, True, True),
    ("dataset.sequence_length", INT, 1, None, True, True),
    ("dataset.seq_length", INT, 1, None, True, True),
    ("dataset.num_workers", INT, 0, None, True, True),
    ("dataset.random_seed", INT, 0, None, True, True),
    ("dataset.mid_level_dataset_surplus", REAL, 0, None, True, True),
    ("logger.log_interval", INT, 1, None, True, True),
    ("logger.throughput_window_size", INT, 2, None, True, True),  # 2 marks span the shortest window: 1 batch
    ("logger.tensorboard_log_interval", INT, 1, None, True, True),
    ("logger.tensorboard_queue_size", INT, 1, None, True, True),
    ("logger.log_eval_samples", INT, 0, None, True, True),
    ("logger.eval_samples_max_new_tokens", INT, 1, None, True, True),
    ("logger.eval_samples_prompt_tokens", INT, 1, None, True, True),
    ("checkpoint.save_interval", INT, 1, None, True, True),
    ("checkpoint.non_persistent_save_interval", INT, 1, None, True, True),
    ("checkpoint.ckpt_step", INT, 0, None, True, True),
    ("optimizer.optimizer_offload_fraction", REAL, 0, 1, True, True),
    ("checkpoint.storage_writers_per_rank", INT, 1, None, True, True),
    ("checkpoint.replication_jump", INT, 1, None, True, True),
    ("checkpoint.replication_factor", INT, 1, None, True, True),
    ("rng.seed", INT, 0, None, True, True),
    ("ddp.bucket_size", INT, 1, None, True, True),
    ("ddp.num_distributed_optimizer_instances", INT, 1, None, True, True),
    ("dist.distributed_timeout_minutes", REAL, 1, None, True, True),
    ("tokenizer.vocab_size", INT, 1, None, True, True),
    ("tokenizer.make_vocab_size_divisible_by", INT, 1, None, True, True),
    ("tokenizer.tiktoken_num_special_tokens", INT, 7, None, True, True),  # megatron's 7 required special tokens
    ("rerun_state_machine.error_injection_rate", INT, 0, None, True, True),
    ("nvrx_straggler.report_time_interval", REAL, 0, None, True, True),
    ("nvrx_straggler.num_gpu_perf_scores_to_print", INT, 0, None, True, True),
    ("nvrx_straggler.gpu_relative_perf_threshold", REAL, 0, 1, True, True),
    ("nvrx_straggler.gpu_individual_perf_threshold", REAL, 0, 1, True, True),
    ("nvrx_straggler.profiling_interval", INT, 1, None, True, True),
    ("straggler.straggler_minmax_count", INT, 1, None, True, True),
)


def _describe_range(kind: str, low: Optional[float], high: Optional[float], low_in: bool, high_in: bool) -> str:
    if low is not None and high is not None:
        return f"{kind} in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"
    if low is not None:
        if kind == INT and low_in and low == 1:
            return "a positive integer"
        return f"{kind} {'>=' if low_in else '>'} {low}"
    return f"{kind} {'<=' if high_in else '<'} {high}"


def check_ranges(cfg: "ConfigContainer") -> None:
    """Every bound in RANGE_RULES, then the exit signal: one ConfigError line naming the first bad field."""
    for path, kind, low, high, low_in, high_in in RANGE_RULES:
        section_name, name = path.split(".")
        section = getattr(cfg, section_name, None)
        if section is None or not hasattr(section, name):
            continue
        value = getattr(section, name)
        if value is None:
            continue
        number_ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind == INT:
            number_ok = number_ok and float(value).is_integer()
        ok = number_ok and math.isfinite(value)
        if ok and low is not None:
            ok = value >= low if low_in else value > low
        if ok and high is not None:
            ok = value <= high if high_in else value < high
        if not ok:
            raise ConfigError(f"{path}={value!r} is out of range: use {_describe_range(kind, low, high, low_in, high_in)}")
    _check_iterations_to_skip(cfg.train.iterations_to_skip if cfg.train is not None else None)
    most_recent_k = cfg.checkpoint.most_recent_k if cfg.checkpoint is not None else None
    if most_recent_k is not None and (isinstance(most_recent_k, bool) or not isinstance(most_recent_k, int)
                                      or (most_recent_k < 1 and most_recent_k != -1)):
        raise ConfigError(f"checkpoint.most_recent_k={most_recent_k!r} is out of range: use -1 (keep every "
                          "checkpoint) or a positive integer (keep that many newest)")
    exit_signal = cfg.train.exit_signal if cfg.train is not None else None
    if exit_signal is not None:
        valid = {int(s) for s in signal.valid_signals()}
        if isinstance(exit_signal, bool) or not isinstance(exit_signal, int) or int(exit_signal) not in valid:
            raise ConfigError(
                f"train.exit_signal={exit_signal!r} is not a signal of this platform: use a signal number such as "
                f"{int(signal.SIGTERM)} (SIGTERM) or {int(signal.SIGINT)} (SIGINT)"
            )


def _check_iterations_to_skip(skip: object) -> None:
    """``train.iterations_to_skip``: a list of counts of completed iterations (non-negative integers)."""
    if skip is None:
        return
    valid = isinstance(skip, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in skip
    )
    if not valid:
        raise ConfigError(f"train.iterations_to_skip={skip!r} is invalid: use a list of iteration counts >= 0")


def positive_int(value: object, name: str) -> int:
    """``value`` if it is a positive integer (not a bool), else a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    return value
