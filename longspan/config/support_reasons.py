"""Why each field longspan does not support stays so: one line per field, shown in docs/config-support.md and at
the end of the NotSupportedError (longspan.config.support reads it).

Keys are "section.field" (every class of the section) or "ClassName.field" (that class only; looked up first).
The model families' providers add theirs when they register (``longspan.config.support.register_model_support``).
"""

from __future__ import annotations

from longspan.config.rules.model import MAMBA_NOT_SUPPORTED_REASONS, T5_NOT_SUPPORTED_REASONS

# The checkpoint, optimizer and ddp fields.
CHECKPOINT_OPTIM_DDP_REASONS: dict[str, str] = {
    "checkpoint.strict_fsdp_dtensor_load": "applies to Megatron-FSDP's fsdp_dtensor checkpoints; longspan writes "
                                           "torch_dist (DCP), whose mismatches checkpoint.dist_ckpt_strictness handles",
    "ddp.preserve_fp32_weights": "longspan always keeps fp32 main weights for low-precision parameters; False "
                                 "(Megatron-FSDP updating the low-precision weights in place) is not built",
    "ddp.keep_fp8_transpose_cache": "a TransformerEngine FP8 weight-transpose cache; torchao's float8 linears keep "
                                    "none",
    "ddp.nccl_ub": "registers Megatron-FSDP's buffers as NCCL user buffers (NVLS/SHARP); FSDP2 allocates its own "
                   "communication buffers and torch has no switch for registering them",
    "ddp.fsdp_double_buffer": "Megatron-FSDP's persistent double buffer for all-gathers (with nccl_ub); FSDP2 "
                              "allocates each unit's all-gather buffer itself",
    "ddp.delay_wgrad_compute": "splits TransformerEngine's weight-gradient GEMMs out of the backward pass to overlap "
                               "them with MoE all-to-all; torch's autograd computes them in the backward pass",
}

NOT_SUPPORTED_REASONS: dict[str, str] = {
    "model.tp_only_amax_red": "Transformer Engine's FP8 amax reduction group; torchao's float8 reduces its amax itself",
    "model.test_mode": "Megatron's own test switch; longspan's tests do not use it",
    "model.restore_modelopt_state": "NVIDIA ModelOpt state: longspan has no ModelOpt integration",
    "model.use_ring_exchange_p2p": "needs a custom PyTorch build with ring_exchange; torch pipelining uses batched isend/irecv",
    "dataset.object_storage_cache_path": "data paths are local files; object-storage reading is not built",
    "HFDatasetSourceConfig.dataset_name": "Bridge's named Hub presets need the Hub; give path_or_dataset and schema_adapter",
    "tokenizer.tokenizer_prompt_format": "multimodal prompt formats belong to Megatron's VLM tokenizers, not built here",
    "tokenizer.image_tag_type": "multimodal image tags belong to Megatron's VLM tokenizers, not built here",
    "dist.enable_megatron_core_experimental": "switches Megatron Core experimental code, which longspan does not run",
}

NOT_SUPPORTED_REASONS.update({
    "MambaProvider.mtp_loss_scaling_factor": "multi-token prediction depths are built for GPTModel only",
})

# The model families' own reasons live beside their checks (config.rules.model); the checkpoint, optimizer and
# ddp ones above.
NOT_SUPPORTED_REASONS.update(T5_NOT_SUPPORTED_REASONS)
NOT_SUPPORTED_REASONS.update({f"MambaProvider.{name}": why for name, (_, why) in MAMBA_NOT_SUPPORTED_REASONS.items()})
NOT_SUPPORTED_REASONS.update(CHECKPOINT_OPTIM_DDP_REASONS)

# Fields Megatron-LM / Megatron Bridge added after the spec, not built yet.
_DEBUG_DUMP = ("Megatron's tensor dumps for debugging are not built; use logger.log_l2_norm_grad_to_tensorboard "
               "or a hook")
_FLIGHT = "NCCL's flight recorder is not configured by longspan; set the TORCH_NCCL_* / TORCH_FR_* variables yourself"
_ROUTING_TRACE = "MoE routing traces are not built; model.moe_per_layer_logging logs the routing's load per layer"
NEWER_BRIDGE_REASONS: dict[str, str] = {
    "dist.lazy_mpu_init": "Megatron-LM's name of dist.lazy_init, which longspan reads: set dist.lazy_init",
    "dist.sharp_enabled_group": "use_sharp always enables SHARP on the data-parallel (dp x cp) communicator",
    "dist.distributed_timeout_seconds_after_init": "process groups keep dist.distributed_timeout_minutes all run",
    "dist.eval_context_parallel_size": "validation runs with the training layout (model.context_parallel_size)",
    **{f"dist.flight_recorder_{n}": _FLIGHT for n in ("dump_path", "trace_buffer_size", "dump_on_timeout",
                                                        "include_stack_trace", "include_only_active",
                                                        "extra_dump_on_exec")},
    "logger.log_memory_interval": "the memory report is printed once, after the first iterations",
    "logger.log_device_memory_used": "nvidia-smi's figure is not read; logger.log_memory_to_tensorboard logs torch's",
    "logger.log_num_zeros_in_grad": "longspan reads optimizer.log_num_zeros_in_grad (the spec's place): set that",
    "logger.log_max_attention_logit": "the max-attention-logit statistic is logged when the model computes it "
                                      "(QK-clip); this switch is not read",
    "logger.barrier_with_L1_time": "longspan reads model.barrier_with_L1_time (the spec's place): set that",
    "logger.mlflow_description": "the MLflow run gets no description; logger.mlflow_tags can carry one",
    "logger.mlflow_log_artifacts": "checkpoints are never uploaded to MLflow (only metrics are logged), whatever "
                                   "the value; the default is accepted",
    **{f"logger.moe_routing_trace_{n}": _ROUTING_TRACE for n in ("path", "max_training_iters", "capture_logits",
                                                                  "capture_hidden_states", "dump_weights")},
    **{f"checkpoint.save_{n}_interval": _DEBUG_DUMP for n in ("params", "activations", "tokens_per_expert",
                                                              "wgrads", "dgrads")},
    "checkpoint.save_retain_interval": "checkpoint.most_recent_k is longspan's (Megatron's) way to delete old "
                                       "checkpoints",
    "checkpoint.use_mp_args_from_checkpoint_args": "the layout always comes from this run's config; a DCP "
                                                   "checkpoint loads into any layout",
    "checkpoint.use_tokenizer_model_from_checkpoint_args": "use_checkpoint_args keeps this run's tokenizer section "
                                                           "as the config gives it",
    "checkpoint.auto_detect_ckpt_format": "longspan reads and writes one format (torch_dist, DCP)",
    "checkpoint.ckpt_convert_update_legacy_dist_opt_format": "Megatron's legacy distributed-optimizer checkpoints "
                                                             "are not read",
    "checkpoint.ckpt_pg_tensors_cache_path": "DCP's save plan is cached by ckpt_assume_constant_structure instead",
    "checkpoint.ckpt_pg_tensors_cache_create": "DCP's save plan is cached by ckpt_assume_constant_structure instead",
    "checkpoint.dist_ckpt_save_pre_mcore_014": "longspan writes one checkpoint layout",
    "checkpoint.verify_integrity": "checkpoint files are not hashed; damaged files are reported when read",
    "checkpoint.custom_manager_class": "longspan's save/load are functions, with no manager protocol to plug into",
    "checkpoint.hf_source_path": "also_save_hf_checkpoint exports with the run's own model family and config",
    "checkpoint.hf_trust_remote_code": "HF exports never run remote code",
    "checkpoint.hf_distributed_save": "also_save_hf_checkpoint's export is written by one rank",
    "checkpoint.hf_save_every_n_ranks": "also_save_hf_checkpoint's export is written by one rank",
}
NOT_SUPPORTED_REASONS.update(NEWER_BRIDGE_REASONS)
