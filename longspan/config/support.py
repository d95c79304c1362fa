"""Which config fields longspan honours: the one table behind validate() and docs/config-support.md.

Every field has a status:
- ``supported``: longspan implements it.
- ``not supported yet``: validate() raises NotSupportedError when it is set to anything but its default.
- ``device-dependent``: implemented where it applies (an accelerator); elsewhere it is listed once at
  start-up as not applicable instead of failing.
- ``performance hint``: a performance switch of Megatron / Transformer Engine (kernel fusion, implementation
  choice, communication scheduling) that changes no maths. longspan runs torch's own kernels and schedules, so
  the switch has no effect; Megatron Bridge configs set these routinely, so they are accepted and listed once
  at start-up as having no effect.

A section has a default status; FIELD_STATUS lists the exceptions, so every field's status is explicit in
the generated document.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from longspan.config.support_reasons import NOT_SUPPORTED_REASONS
from longspan.config.types import is_derived_field, yaml_fields
from longspan.core.errors import NotSupportedError
from longspan.core.plugins import load_plugins

SUPPORTED = "supported"
NOT_SUPPORTED = "not supported yet"
DEVICE = "device-dependent"
HINT = "performance hint (no effect)"

# Status of fields the table below does not name.
SECTION_DEFAULT: dict[str, str] = {
    "rng": SUPPORTED,
    "rerun_state_machine": SUPPORTED,
    "train": SUPPORTED,
    "model": NOT_SUPPORTED,
    "optimizer": NOT_SUPPORTED,
    "ddp": NOT_SUPPORTED,
    "scheduler": SUPPORTED,
    "dataset": SUPPORTED,
    "logger": SUPPORTED,
    "tokenizer": NOT_SUPPORTED,
    "checkpoint": NOT_SUPPORTED,
    "dist": NOT_SUPPORTED,
    "ft": SUPPORTED,
    "straggler": SUPPORTED,
    "nvrx_straggler": SUPPORTED,
    "profiling": SUPPORTED,
    "peft": SUPPORTED,
    "mixed_precision": NOT_SUPPORTED,
    "inprocess_restart": SUPPORTED,
}


def _many(section: str, status: str, names: str) -> dict[str, str]:
    return {f"{section}.{n}": status for n in names.split()}


FIELD_STATUS: dict[str, str] = {
    **_many("rerun_state_machine", SUPPORTED, "check_for_nan_in_loss"),
    **_many("train", DEVICE, "empty_unused_memory_level train_sync_interval"),
    # The model: what the GPT model and the tensor/sequence/data parallel plans build.
    **_many("model", SUPPORTED, """
        tensor_model_parallel_size sequence_parallel perform_initialization fp16 bf16 params_dtype
        deterministic_mode pipeline_dtype barrier_with_L1_time
        num_layers hidden_size num_attention_heads num_query_groups ffn_hidden_size kv_channels softmax_scale
        hidden_dropout attention_dropout layernorm_epsilon normalization qk_layernorm add_bias_linear
        add_qkv_bias gated_linear_unit activation_func calculate_per_token_loss init_method_std
        init_model_with_meta_device attention_softmax_in_fp32 recompute_granularity recompute_method
        recompute_num_layers recompute_modules share_embeddings_and_output_weights make_vocab_size_divisible_by
        position_embedding_type rotary_base rotary_percent rope_scaling rope_scaling_factor seq_length
        vocab_size should_pad_vocab parallel_output fp16_lm_cross_entropy
        """),
    **_many("model", SUPPORTED, """
        embedding_init_method_std seq_len_interpolation_factor low_freq_factor high_freq_factor old_context_len
        """),
    # Context parallel: one flat cp group, all-gather of K/V; every cp_comm_type computes the same
    # exact attention, so the communication choice is a hint (validate() still checks its value).
    **_many("model", SUPPORTED, "context_parallel_size"),
    **_many("model", HINT, "cp_comm_type"),
    # Pipeline parallel: stages on torch.distributed.pipelining. Its schedules always batch their
    # send/recv pairs and post sends asynchronously, so the p2p knobs below change no maths.
    **_many("model", SUPPORTED, """
        pipeline_model_parallel_size virtual_pipeline_model_parallel_size microbatch_group_size_per_vp_stage
        pipeline_parallel_schedule
        num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage
        account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split batch_p2p_comm batch_p2p_sync
        """),
    **_many("model", HINT, "overlap_p2p_comm overlap_p2p_comm_warmup_flush deallocate_pipeline_outputs"),
    **_many("model", DEVICE, "use_cpu_initialization"),
    # FP8 through torchao float8 (longspan.parallel.float8): CUDA with FP8 hardware only; set
    # elsewhere, the model build raises one line.
    **_many("model", DEVICE, "fp8 fp8_recipe fp8_param"),
    **_many("mixed_precision", DEVICE, "fp8 fp8_recipe fp8_param_gather"),
    # The chunked linear + cross-entropy (longspan.models.loss). cross_entropy_fusion_impl='te' names Transformer
    # Engine's kernel for the same cross-entropy: a hint (the chunked loss computes it here).
    **_many("model", SUPPORTED, "cross_entropy_loss_fusion"),
    **_many("model", HINT, "cross_entropy_fusion_impl"),
    **_many("model", HINT, """
        bias_activation_fusion masked_softmax_fusion persist_layer_norm memory_efficient_layer_norm
        bias_dropout_fusion apply_rope_fusion gradient_accumulation_fusion
        """),
    # Mixture of experts and expert parallel: longspan.models.moe, longspan.parallel.expert_parallel.
    # Tokens always move by all-to-all (every dispatcher type computes the same), so the dispatcher type
    # changes no maths.
    **_many("model", SUPPORTED, """
        num_moe_experts moe_router_topk moe_ffn_hidden_size moe_shared_expert_intermediate_size
        moe_shared_expert_gate moe_layer_freq moe_router_load_balancing_type moe_aux_loss_coeff moe_z_loss_coeff
        moe_router_pre_softmax moe_router_score_function moe_router_num_groups moe_router_group_topk
        moe_router_topk_scaling_factor moe_router_dtype moe_expert_capacity_factor moe_pad_expert_input_to_capacity
        moe_token_drop_policy moe_token_dispatcher_type moe_per_layer_logging expert_model_parallel_size
        expert_tensor_parallel_size
        """),
    # DeepSeek-V3 routing (longspan.models.moe): the aux-loss-free expert bias (updated once per step by
    # longspan.parallel.expert_parallel.update_expert_biases), device-limited routing (group-limited top-k over
    # expert-parallel ranks), router input jitter, and moe_token_dropping as the switch that requires the
    # capacity factor its dropping uses.
    **_many("model", SUPPORTED, """
        moe_router_enable_expert_bias moe_router_bias_update_rate moe_router_topk_limited_devices
        moe_input_jitter_eps moe_token_dropping
        """),
    # Grouped expert GEMMs (longspan.models.moe, longspan.models.grouped_gemm): True runs all local experts in
    # one torch._grouped_mm per projection, False the expert-by-expert loop (the reference), as in Megatron.
    **_many("model", SUPPORTED, "moe_grouped_gemm"),
    # Latent MoE (Nemotron 3): the routed experts work in a projected space (longspan.models.moe), the
    # projections split along the latent over tp (longspan.parallel.expert_parallel).
    **_many("model", SUPPORTED, "moe_latent_size"),
    # Tokens are always permuted on the device (longspan.models.moe.permute), so the fusion switch and the
    # overlap switches change no maths.
    **_many("model", HINT, "moe_permute_fusion moe_shared_expert_overlap overlap_moe_expert_parallel_comm"),
    **_many("optimizer", SUPPORTED, """
        optimizer lr min_lr weight_decay fp16 bf16 params_dtype loss_scale initial_loss_scale min_loss_scale
        loss_scale_window hysteresis adam_beta1 adam_beta2 adam_eps decoupled_weight_decay sgd_momentum
        use_distributed_optimizer clip_grad log_num_zeros_in_grad barrier_with_L1_time
        """),
    # Muon (longspan.training.optim.muon): orthogonalised momentum on the weight matrices, AdamW on the rest.
    **_many("optimizer", SUPPORTED, """
        muon_momentum muon_split_qkv muon_use_nesterov muon_scale_mode muon_fp32_matmul_prec muon_num_ns_steps
        muon_tp_mode muon_extra_scale_factor
        """),
    **_many("ddp", SUPPORTED, "grad_reduce_in_fp32 overlap_grad_reduce use_distributed_optimizer bucket_size "
                              "average_in_collective"),
    # The precision-aware optimizer (longspan.training.optim.precision_aware_adam) and FSDP2's explicit
    # all-gather prefetch for ddp.overlap_param_gather (longspan.parallel.data_parallel.set_explicit_prefetch).
    **_many("optimizer", SUPPORTED, "use_precision_aware_optimizer main_grads_dtype main_params_dtype "
                                    "exp_avg_dtype exp_avg_sq_dtype"),
    **_many("ddp", SUPPORTED, "overlap_param_gather"),
    # Checks of the reduced gradients before the update (longspan.training.step.grad_checks).
    **_many("ddp", SUPPORTED, "check_for_nan_in_grad check_for_large_grads"),
    **_many("dataset", NOT_SUPPORTED, "num_dataset_builder_threads object_storage_cache_path"),
    # FinetuningDatasetConfig: longspan.data.sft (JSONL under dataset_root, packing).
    **_many("dataset", SUPPORTED, """
        dataset_root seq_length seed memmap_workers max_train_samples packed_sequence_specs dataset_kwargs
        do_validation do_test
        """),
    **_many("dataset", DEVICE, "pin_memory"),
    **_many("tokenizer", SUPPORTED, "tokenizer_type tokenizer_model vocab_size vocab_file merge_file "
                                    "hf_tokenizer_kwargs chat_template"),
    **_many("checkpoint", SUPPORTED, """
        save save_interval save_optim save_rng load load_optim load_rng finetune pretrained_checkpoint ckpt_step
        use_checkpoint_args exit_on_missing_checkpoint ckpt_format fully_parallel_save async_save also_save_hf_checkpoint
        use_persistent_ckpt_worker fully_parallel_load most_recent_k
        """),
    # Energy counters (longspan.training.observability.energy); without any readable counter setup() lists
    # the field as not applicable.
    **_many("logger", DEVICE, "log_energy"),
    **_many("logger", DEVICE, "log_memory_to_tensorboard"),
    **_many("dist", SUPPORTED, "distributed_timeout_minutes local_rank use_torch_fsdp2 use_tp_pp_dp_mapping "
                               "use_gloo_process_groups"),
    **_many("dist", DEVICE, "distributed_backend external_gpu_device_mapping"),
    **_many("profiling", DEVICE, "use_nsys_profiler record_memory_history memory_snapshot_path"),
    **_many("mixed_precision", SUPPORTED, """
        fp32 fp16 bf16 params_dtype pipeline_dtype autocast_dtype autocast_enabled grad_reduce_in_fp32 loss_scale
        initial_loss_scale min_loss_scale loss_scale_window hysteresis
        """),
    # Switches no behaviour code reads get their honest status (later keys override earlier ones).
    # longspan always builds on the meta device, keeps the vocabulary padded to make_vocab_size_divisible_by,
    # computes the loss from whatever the output layer's plan produces, and torch's pipelining batches p2p
    # itself: these Megatron switches change no maths here.
    **_many("model", HINT, "init_model_with_meta_device parallel_output should_pad_vocab batch_p2p_sync "
                           "moe_token_dispatcher_type"),
    # RoPE scalings (longspan.models.rope: YaRN with Megatron's names, dynamic NTK and LongRoPE with typed fields),
    # interleaved rotary pairs, the residual stream's placement and precision, and the attention softmax's
    # precision (True: SDPA's fp32 accumulation; False: scores and probabilities in the activations' dtype).
    **_many("model", SUPPORTED, """
        yarn_rotary_scaling_factor yarn_original_max_position_embeddings yarn_beta_fast yarn_beta_slow yarn_mscale
        yarn_mscale_all_dim yarn_correction_range_round_to_int rope_dynamic_factor rope_longrope_short_factor
        rope_longrope_long_factor rope_original_max_position_embeddings rope_attention_factor rotary_interleaved
        apply_residual_connection_post_layernorm fp32_residual_connection attention_softmax_in_fp32
        multi_latent_attention
        """),
    # Autocast (model.enable_autocast / mixed_precision.autocast_enabled) runs the forward step in
    # torch.autocast(autocast_dtype or the pipeline dtype).
    **_many("model", SUPPORTED, "enable_autocast autocast_dtype"),
    # DCP writes each rank's own shards and de-duplicates replicated tensors by itself; asynchronous saves run
    # on DCP's own background thread: these checkpoint switches change no result.
    **_many("checkpoint", HINT, "fully_parallel_save fully_parallel_load use_persistent_ckpt_worker"),
    # torch DDP always overlaps the gradient all-reduce with backward (bucket hooks); FSDP2 its reduce-scatter.
    **_many("ddp", HINT, "overlap_grad_reduce"),
    # Padding each expert's input up to its capacity adds rows whose outputs are discarded: the same result.
    # torch.distributed.pipelining always batches its send/recv pairs: batch_p2p_comm changes no maths.
    **_many("model", HINT, "moe_pad_expert_input_to_capacity batch_p2p_comm"),
    # Current Megatron Bridge names: accepted with their meaning, or honestly not supported yet.
    **_many("logger", SUPPORTED, """
        skip_train_metrics_log log_throughput_to_tensorboard mlflow_experiment mlflow_run_name mlflow_tracking_uri
        mlflow_tags comet_project comet_experiment_name comet_workspace comet_api_key comet_tags save_config_filepath
        """),
    **_many("logger", SUPPORTED, "throughput_window_size"),  # observability/reports.py:report_throughput
    **_many("logger", NOT_SUPPORTED, "memory_keys log_l2_norm_grad_to_tensorboard "
                                     "log_runtime_to_tensorboard runtime_time_unit"),
    **_many("train", NOT_SUPPORTED, "check_optimizer_step_success skip_sync_grad_norm_across_mp"),
    **_many("train", SUPPORTED, "iterations_to_skip"),  # training/train.py:_skip_iteration
    **_many("checkpoint", HINT, "async_strategy"),
    **_many("dataset", SUPPORTED, "seq_length"),
    **_many("optimizer", SUPPORTED, "finetune_lr"),
    # The embedding and output layer's own param group (longspan.training.optim.optimizer.get_param_groups).
    **_many("optimizer", SUPPORTED, "decoupled_lr decoupled_min_lr"),
    # Resilience: longspan.training.resilience, docs/resilience.md.
    **_many("checkpoint", SUPPORTED, """
        non_persistent_save_interval non_persistent_ckpt_type non_persistent_global_ckpt_dir
        non_persistent_local_ckpt_dir
        """),
    # Every rank writes all of its own local state (nothing is replicated across ranks to de-duplicate), so
    # 'fully_parallel' and 'atomic' write the same files.
    **_many("checkpoint", HINT, "non_persistent_local_ckpt_algo"),
    # In-process restart (resilience/inprocess.py): soft_timeout and active_world_size are real
    # (tests/resilience/test_inprocess_restart.py::test_soft_timeout_interrupts_a_stalled_rank_in_place and
    # ::test_a_warm_reserve_takes_a_killed_ranks_place).
}


# Mamba and hybrid models: longspan.models.mamba (MambaProvider).
FIELD_STATUS.update(_many("model", SUPPORTED, """
    mamba_num_groups mamba_state_dim mamba_head_dim mamba_num_heads mamba_chunk_size mamba_conv_kernel
    mamba_expand mamba_dt_limit_min hybrid_attention_ratio hybrid_mlp_ratio hybrid_override_pattern
    """))

# Multi-latent attention (longspan.models.mla): GPT models only.
FIELD_STATUS.update(_many("model", SUPPORTED, """
    multi_latent_attention q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim rotary_scaling_factor
    mscale mscale_all_dim mla_latent_layernorm_epsilon
    """))

# Sliding-window attention (longspan.models.sliding_window): per-layer windows, packing, CP, the KV cache.
FIELD_STATUS.update(_many("model", SUPPORTED, "window_size window_attn_skip_freq"))

# Gemma 2/3 and OLMo-2 (longspan.models.transformer / gpt): norm form and placement, QK-norm across heads,
# embedding scaling, soft-capping.
FIELD_STATUS.update(_many("model", SUPPORTED, """
    layernorm_zero_centered_gamma layernorm_before_sublayers layernorm_after_sublayers qk_layernorm_across_heads
    apply_embedding_scaling attn_logit_softcapping final_logit_softcapping
    """))

# GPT-OSS (longspan.models.attention_sinks, activations.gated_activation): attention sinks, the gated MLP's
# linear offset and clamp.
FIELD_STATUS.update(_many("model", SUPPORTED, "softmax_type glu_linear_offset activation_func_clamp_value"))

# Gated DeltaNet hybrids (longspan.models.gated_delta_net, gated_delta_rule): the linear-attention layers, their
# sizes, and the full-attention layers' output gate (tests/models/test_gated_delta_net.py).
FIELD_STATUS.update(_many("model", SUPPORTED, """
    experimental_attention_variant linear_attention_freq linear_conv_kernel_dim linear_key_head_dim
    linear_value_head_dim linear_num_key_heads linear_num_value_heads attention_output_gate
    """))

# T5: longspan.models.t5 (T5ModelProvider), longspan.data.t5_dataset (T5MaskedWordPieceDatasetConfig).
FIELD_STATUS.update(_many("model", SUPPORTED, """
    encoder_num_layers relative_attention_num_buckets relative_attention_max_distance max_position_embeddings
    seq_length_dec scale_decoder_outputs encoder_pipeline_model_parallel_size
    """))
FIELD_STATUS.update(_many("tokenizer", SUPPORTED, "vocab_extra_ids"))
# dataset.masking_do_permutation: tests/models/t5/test_t5_dataset.py::test_samples_equal_megatron_core[permuted-ngrams].

# The model classes and dataset classes longspan can build.
# (Model families' providers register theirs: register_model_support; supported_models() lists them all.)
SUPPORTED_MODELS = ("GPTModelProvider", "T5ModelProvider", "MambaProvider")
SUPPORTED_DATASETS = ("GPTDatasetConfig", "MockGPTDatasetConfig", "T5MaskedWordPieceDatasetConfig",
                      "FinetuningDatasetConfig", "DirectHFSFTDatasetConfig")
# Classes nested inside a dataset section (their fields have their own tables in the generated document).
NESTED_DATASET_CLASSES = ("HFDatasetSourceConfig", "ChatSFTPreprocessingConfig")


# T5ModelProvider takes the shared table's parallel and model rows except those listed below, each proven for T5:
# sequence_parallel, context_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size
# (tests/models/t5/test_t5_layouts.py: TP2 + SP, CP2, PP2 x VP2 x TP2 against one process);
# num_layers_in_first/last_pipeline_stage, account_for_*_in_pipeline_split, encoder_pipeline_model_parallel_size
# (test_t5_model.py::test_t5_pipeline_split_counts_encoder_and_decoder_layers_together and chained stages);
# recompute_* (test_t5_recompute.py); qk_layernorm, apply_residual_connection_post_layernorm,
# layernorm_zero_centered_gamma, attention_softmax_in_fp32 (test_t5_model.py::test_model_feature_fields_change_the_t5_model);
# rotary_percent, rotary_interleaved, seq_len_interpolation_factor (::test_rotary_positions_and_their_fields_change_the_t5_model).
# fp32_residual_connection (::test_fp32_residual_keeps_t5s_stream_in_float32_and_norm_outputs_in_the_parameters_dtype).
# window_size, window_attn_skip_freq (::test_sliding_window_reaches_every_t5_attention_as_megatron_does).
# Why the rest stay not supported: longspan.config.rules.model.T5_NOT_SUPPORTED_REASONS.
# Per config class: fields the shared table supports (for GPT) that this class does not implement. validate()
# rejects them when set; the generated document lists them in the class's own table.
CLASS_FIELD_STATUS: dict[str, dict[str, str]] = {
    "T5ModelProvider": _many("model", NOT_SUPPORTED, """
        num_moe_experts expert_model_parallel_size expert_tensor_parallel_size
        multi_latent_attention
        """),
    # Why each is not built: longspan.config.rules.model.MAMBA_NOT_SUPPORTED_REASONS. The hybrid stack's
    # window_size / window_attn_skip_freq (tests/models/mamba/test_mamba_model.py::
    # test_sliding_window_reaches_the_hybrid_attention_layers_by_their_index_in_the_whole_stack, and the CP2
    # case of test_mamba_tensor_parallel.py) and apply_residual_connection_post_layernorm
    # (::test_residual_post_layernorm_changes_the_hybrid_attention_and_mlp_layers_only) are built.
    "MambaProvider": _many("model", NOT_SUPPORTED, "multi_latent_attention"),
}

# Direct HF SFT data (longspan.data.sft.hf_dataset): the run's tokenizer formats the rows; Bridge's named Hub
# presets are not implemented. In-batch packing (enable_in_batch_packing, defer_in_batch_packing_to_step,
# in_batch_packing_pad_to_multiple_of): tests/data/sft_hf/test_hf_sft_in_batch_packing.py.
CLASS_FIELD_STATUS["DirectHFSFTDatasetConfig"] = {
    **_many("dataset", SUPPORTED, """
        seq_length source source_weights blend_seed validation_source test_source preprocessing do_validation
        do_test pad_to_max_length pad_to_multiple_of dataloader_type hf_processor_path hf_processor_kwargs
        enable_in_batch_packing defer_in_batch_packing_to_step in_batch_packing_pad_to_multiple_of
        """),
    **_many("dataset", NOT_SUPPORTED, "skip_getting_attention_mask_from_dataset"),
    # Right padding under the causal mask never reaches a real token: a padding mask from the data changes nothing.
    **_many("dataset", HINT, "skip_getting_attention_mask_from_dataset"),
}
CLASS_FIELD_STATUS["HFDatasetSourceConfig"] = {
    **_many("dataset", SUPPORTED, "path_or_dataset split subset load_kwargs schema_adapter adapter_kwargs"),
    **_many("dataset", NOT_SUPPORTED, "dataset_name"),
}
CLASS_FIELD_STATUS["ChatSFTPreprocessingConfig"] = _many("dataset", SUPPORTED, "loss_mode")

# Multi-token prediction (longspan.models.mtp): GPT models only, on one pipeline stage without context parallel.
FIELD_STATUS.update(_many("model", SUPPORTED, "mtp_num_layers mtp_loss_scaling_factor"))
for _cls in ("T5ModelProvider", "MambaProvider"):
    CLASS_FIELD_STATUS[_cls].update(_many("model", NOT_SUPPORTED, "mtp_num_layers mtp_loss_scaling_factor"))
# mtp_enabled states what mtp_num_layers switches (config rules: a contradiction is an error).
FIELD_STATUS.update(_many("model", SUPPORTED, "mtp_enabled"))

# Added special tokens, Megatron's TikTokenizer (longspan.data.tiktoken_tokenizer) and the tokenizer-side
# vocabulary padding (longspan.data.tokenizers).
FIELD_STATUS.update(_many("tokenizer", SUPPORTED, """
    special_tokens tiktoken_pattern tiktoken_num_special_tokens tiktoken_special_tokens make_vocab_size_divisible_by
    metadata_path
    """))

# Logger reports (training/observability: log_line.py, reports.py, utils/norms.py, memory.py). The memory names
# map applies to the CUDA allocator statistics, so it is device-dependent like log_memory_to_tensorboard.
FIELD_STATUS.update(_many("logger", SUPPORTED, "log_l2_norm_grad_to_tensorboard log_runtime_to_tensorboard "
                                               "runtime_time_unit"))
FIELD_STATUS.update(_many("logger", DEVICE, "memory_keys"))
# Megatron skips a model-parallel collective with these; longspan's optimizer always agrees on the step's success
# (found-inf reduced over every rank) and its gradient norm is the global DTensor norm: they change no result.
FIELD_STATUS.update(_many("train", HINT, "check_optimizer_step_success skip_sync_grad_norm_across_mp"))

# Activation offload through torch's saved-tensor hooks (longspan.parallel.offload); TE's double buffering of the
# reloads has no counterpart (each copy is asynchronous by itself).
FIELD_STATUS.update(_many("model", SUPPORTED, "cpu_offloading cpu_offloading_num_layers cpu_offloading_activations "
                                              "cpu_offloading_weights"))
FIELD_STATUS.update(_many("model", HINT, "cpu_offloading_double_buffering"))

# Asynchronous tensor parallel (longspan.parallel.async_tp): inductor's micro-pipelined all-gather/reduce-scatter
# GEMMs through symmetric memory, on CUDA. Transformer Engine's userbuffer knobs tune its own kernels: no maths.
FIELD_STATUS.update(_many("model", DEVICE, "tp_comm_overlap"))
FIELD_STATUS.update(_many("model", HINT, """
    tp_comm_bulk_wgrad tp_comm_bulk_dgrad tp_comm_overlap_ag tp_comm_overlap_rs tp_comm_overlap_rs_dgrad
    tp_comm_split_ag tp_comm_atomic_ag tp_comm_split_rs tp_comm_atomic_rs tp_comm_overlap_disable_qkv
    tp_comm_overlap_disable_fc1 tp_comm_bootstrap_backend tp_comm_overlap_cfg
    """))

# Megatron's attention implementations as SDPA kernel choices (longspan.models.attention_backend).
FIELD_STATUS.update(_many("model", DEVICE, "attention_backend"))

# Switches that change no result here: Transformer Engine's implementation choices (longspan builds plain torch
# modules that compute the same maths), switches Megatron Core itself deprecated and ignores, an fp16 rescaling
# that cancels inside Megatron's softmax (SDPA accumulates in fp32), the sequence-parallel scatter's clone (a
# DTensor plan has no buffer to clone), an inference decoding kernel, the pipeline stages' reduction schedule
# (FSDP2/DDP launch their own reductions) and the dataset builder's thread count (indices are built once and cached).
FIELD_STATUS.update(_many("model", HINT, """
    async_tensor_model_parallel_allreduce moe_extended_tp disable_parameter_transpose_cache
    use_transformer_engine_op_fuser use_transformer_engine_full_layer_spec transformer_impl
    clone_scatter_output_in_embedding apply_query_key_layer_scaling flash_decode
    """))
FIELD_STATUS.update(_many("dist", HINT, "align_grad_reduce"))
# Megatron's RNG-tracker class choices (Transformer Engine's CUDA-graph-safe tracker, the inference tracker) seed
# and fork the same streams; longspan draws from torch's generators (rng.seed) whichever is named.
FIELD_STATUS.update(_many("rng", HINT, "te_rng_tracker inference_rng_tracker"))
FIELD_STATUS.update(_many("model", HINT, "use_te_rng_tracker inference_rng_tracker"))
FIELD_STATUS.update(_many("dataset", HINT, "num_dataset_builder_threads"))

# Per-group NCCL options on CUDA (longspan.parallel.nccl_options; names and file checked by validate everywhere).
FIELD_STATUS.update(_many("dist", DEVICE, "high_priority_stream_groups nccl_communicator_config_path"))

# Checkpoint, optimizer and ddp switches (longspan.training.checkpointing.replication: local checkpoints
# replicated to clique peers).
FIELD_STATUS.update(_many("checkpoint", SUPPORTED, "replication replication_jump replication_factor"))
# Optimizer CPU offload (longspan.training.optim.cpu_offload): pinned host buffers and copies on a side stream
# need CUDA; the offloaded part always steps with torch's own optimizer.
FIELD_STATUS.update(_many("optimizer", SUPPORTED, "optimizer_cpu_offload optimizer_offload_fraction "
                                                  "apply_wd_to_qk_layernorm"))
FIELD_STATUS.update(_many("optimizer", DEVICE, "pin_cpu_grads pin_cpu_params overlap_cpu_optimizer_d2h_h2d"))
FIELD_STATUS.update(_many("optimizer", HINT, "use_torch_optimizer_for_cpu_offload"))
# Megatron-FSDP's strategies mapped onto the distributed optimizer / FSDP2 (config/rules/data_parallel.py); replicas
# of the sharded optimizer as HSDP. align_param_gather: torch.distributed.pipelining runs each stage's FSDP2
# all-gather when that stage's forward starts; launching them together changes when, not what, is gathered.
FIELD_STATUS.update(_many("ddp", SUPPORTED, "data_parallel_sharding_strategy num_distributed_optimizer_instances"))
FIELD_STATUS.update(_many("ddp", HINT, "align_param_gather"))
# One Megatron switch each: optimizer.overlap_param_gather mirrors ddp's, ddp.fp8_param_gather switches on
# model.fp8_param (config/rules/data_parallel.py). Communication layout switches that change no maths: the
# interleaved pipeline's all-gather during the optimizer step, NCCL bucket padding, Megatron-FSDP's fused division
# and communication unit size.
FIELD_STATUS.update(_many("optimizer", SUPPORTED, "overlap_param_gather"))
FIELD_STATUS.update(_many("ddp", DEVICE, "fp8_param_gather"))
FIELD_STATUS.update(_many("optimizer", HINT, "overlap_param_gather_with_optimizer_step"))
FIELD_STATUS.update(_many("ddp", HINT, "pad_buckets_for_high_nccl_busbw gradient_reduce_div_fusion "
                                       "suggested_communication_unit_size"))
# DCP checkpoints are always fully reshardable (optimizer state keyed by parameter name, each rank writing its
# own shards without gathering): the two switches asking for it change nothing here.
FIELD_STATUS.update(_many("checkpoint", HINT, "dist_ckpt_optim_fully_reshardable "
                                              "distrib_optim_fully_reshardable_mem_efficient"))
# DCP's writer threads (one file each), its save-plan cache, the tokenizer files beside the weights.
FIELD_STATUS.update(_many("checkpoint", SUPPORTED, "storage_writers_per_rank ckpt_assume_constant_structure "
                                                   "save_tokenizer_assets load_main_params_from_ckpt "
                                                   "dist_ckpt_strictness ckpt_convert_format ckpt_convert_save"))
# The MoE layer checkpointed and replayed in backward (longspan.models.moe.MoELayer); its metrics and token counts
# are recorded by the first forward only.
FIELD_STATUS.update(_many("model", SUPPORTED, "moe_layer_recompute"))
# Per-microbatch recompute depth in the pipeline schedules (longspan.training.step.pipeline_schedules, megatron-core's
# window rule; GPT and T5 blocks).
FIELD_STATUS.update(_many("model", SUPPORTED, "num_microbatches_with_partial_activation_checkpoints"))
# megatron-core's config logger for the built model chunks (longspan.training.observability.config_logger).
FIELD_STATUS.update(_many("model", SUPPORTED, "config_logger_dir"))
# Context parallel is one flat all-gather group whatever Megatron's communication scheme: the a2a+p2p sub-group sizes
# are checked as megatron-core builds its groups (config/rules/layout.py) and change no maths. Pipeline stages always
# exchange seq_length-shaped activations (SFT data pads to seq_length under pipeline parallel), which Megatron's
# variable-length shape exchange also handles. The pipeline group's backend (parallel/init.py): 'nccl' needs CUDA.
FIELD_STATUS.update(_many("model", HINT, "hierarchical_context_parallel_sizes variable_seq_lengths"))
FIELD_STATUS.update(_many("model", DEVICE, "pipeline_model_parallel_comm_backend"))
# CUDA graphs of the layers through torch.compile's CUDA-graph trees (longspan.parallel.compile; external_cuda_graph,
# Transformer Engine's capture of the same layers, maps onto it too); elsewhere listed once at start-up.
FIELD_STATUS.update(_many("model", DEVICE, "enable_cuda_graph cuda_graph_warmup_steps external_cuda_graph"))
# T5: the float32 residual stream (longspan.models.t5.T5Layer, as GPT's); Megatron's fused cross-entropy kernels
# compute the same loss as T5's logits-then-loss, so the fusion switch is a hint there.
CLASS_FIELD_STATUS["T5ModelProvider"].update(_many("model", HINT, "cross_entropy_loss_fusion"))
# When Megatron computes weight gradients (after the MoE all-to-all, at the pipeline flush) and how it lays out
# recompute's saved inputs change no result; megatron-core's consistency rules are kept (rules/scheduling_hints.py).
FIELD_STATUS.update(_many("model", HINT, "distribute_saved_activations delay_wgrad_compute "
                                         "defer_embedding_wgrad_compute wgrad_deferral_limit"))
# Where sequence parallel cuts the embedded sequence: after the embedding, or (False) before the first layer
# (longspan.parallel.tensor_parallel._sequence_scatter_plan; tests/parallel/test_tp_plans.py::
# test_split_model_matches_whole_model[tp2_sp_scatter_after_embedding_off] shows the cut and one process's losses).
FIELD_STATUS.update(_many("model", SUPPORTED, "scatter_embedding_sequence_parallel"))
# Megatron-FSDP runs as PyTorch FSDP2 (config/rules/data_parallel.py apply_megatron_fsdp; parity:
# tests/parallel/test_layout_parity.py[dp2_megatron_fsdp]). lazy_init: training/initialize.py returns the finisher
# (tests/parallel/test_lazy_init.py). use_sharp: NCCL CollNet on the data-parallel communicator, CUDA only
# (parallel/nccl_options.py). straggler_ctrlr_port: rank 0's HTTP toggle (training/resilience/straggler_control.py,
# tests/resilience/test_straggler_control.py).
FIELD_STATUS.update(_many("ddp", SUPPORTED, "use_megatron_fsdp use_custom_fsdp"))
# Bridge's newer fields (support_reasons.NEWER_BRIDGE_REASONS says why the others stay not supported). dist's
# use_megatron_fsdp is read with ddp's (Bridge sets both from either); the checkpoint writer's process priorities,
# Megatron's fully-parallel exchange choices and its sharding check change no bytes of a DCP checkpoint.
FIELD_STATUS.update(_many("dist", SUPPORTED, "use_megatron_fsdp"))
FIELD_STATUS.update(_many("dist", HINT, "disable_jit_fuser use_decentralized_pg"))
FIELD_STATUS.update(_many("logger", NOT_SUPPORTED, """log_memory_interval log_device_memory_used log_num_zeros_in_grad
    log_max_attention_logit barrier_with_L1_time mlflow_description mlflow_log_artifacts moe_routing_trace_path
    moe_routing_trace_max_training_iters moe_routing_trace_capture_logits moe_routing_trace_capture_hidden_states
    moe_routing_trace_dump_weights"""))
FIELD_STATUS.update(_many("checkpoint", HINT, """async_ckpt_cpu_priority async_ckpt_io_priority async_ckpt_use_cpu_shm
    async_write_results_mp_mode ckpt_fully_parallel_load_exchange_algo ckpt_fully_parallel_load_per_rank_objects
    ckpt_fully_parallel_save_process_group ckpt_fully_parallel_load_process_group ckpt_load_validate_sharding_integrity
    dist_ckpt_workers"""))
FIELD_STATUS.update(_many("dist", SUPPORTED, "lazy_init"))
FIELD_STATUS.update(_many("dist", DEVICE, "use_sharp"))


# Model provider classes registered by their packages (the model families above this package), in order, with
# the class whose table of the generated document theirs repeats.
REGISTERED_MODELS: dict[str, str] = {}


def register_model_support(name: str, supported: str, not_supported: str, reasons: dict[str, str],
                           shared_table: str = "GPTModelProvider") -> None:
    """Make model provider class ``name`` buildable, with the statuses of its own fields over the shared table's
    (``supported`` / ``not_supported``: space-separated field names), the one-line reason of each field it does
    not support (``field -> reason``) and the class whose table its own repeats in docs/config-support.md."""
    CLASS_FIELD_STATUS[name] = {**_many("model", SUPPORTED, supported), **_many("model", NOT_SUPPORTED, not_supported)}
    NOT_SUPPORTED_REASONS.update({f"{name}.{field}": why for field, why in reasons.items()})
    REGISTERED_MODELS[name] = shared_table


def supported_models() -> tuple[str, ...]:
    """The model provider classes longspan can build (the model kinds' and the registered ones)."""
    load_plugins()
    return SUPPORTED_MODELS + tuple(REGISTERED_MODELS)


def not_supported_reason(section: str, name: str, cls_name: str | None = None) -> str | None:
    """The one-line reason ``section.name`` (of config class ``cls_name``) is not supported, if one is given."""
    load_plugins()
    if cls_name and f"{cls_name}.{name}" in NOT_SUPPORTED_REASONS:
        return NOT_SUPPORTED_REASONS[f"{cls_name}.{name}"]
    return NOT_SUPPORTED_REASONS.get(f"{section}.{name}")


def field_status(section: str, name: str, cls_name: str | None = None) -> str:
    """The status of ``section.name`` (of config class ``cls_name`` when given)."""
    load_plugins()
    override = CLASS_FIELD_STATUS.get(cls_name or "", {}).get(f"{section}.{name}")
    if override is not None:
        return override
    return FIELD_STATUS.get(f"{section}.{name}", SECTION_DEFAULT.get(section, NOT_SUPPORTED))


def _default_of(cls: type, f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _differs(value: Any, default: Any) -> bool:
    if default is dataclasses.MISSING:
        return False
    try:
        return bool(value != default)
    except Exception:  # noqa: BLE001 - incomparable objects count as different
        return True


def _sections(cfg: Any) -> list[tuple[str, Any]]:
    out = []
    for name in SECTION_DEFAULT:
        obj = getattr(cfg, name, None)
        if obj is not None and dataclasses.is_dataclass(obj):
            out.append((name, obj))
    return out


def unsupported_settings(cfg: Any) -> list[str]:
    """'section.field=value (supported: default)' for every not-supported field set to a non-default value,
    followed by ': reason' when NOT_SUPPORTED_REASONS gives one."""
    found: list[str] = []
    model_cls = type(cfg.model).__name__ if cfg.model is not None else None
    if model_cls is not None and model_cls not in supported_models():
        found.append(f"model={model_cls} (supported: {', '.join(supported_models())})")
    dataset_cls = type(cfg.dataset).__name__ if cfg.dataset is not None else None
    if dataset_cls is not None and dataset_cls not in SUPPORTED_DATASETS:
        found.append(f"dataset={dataset_cls} (supported: {', '.join(SUPPORTED_DATASETS)})")
    for section, obj in _sections(cfg):
        for f in yaml_fields(obj):
            if is_derived_field(f) or field_status(section, f.name, type(obj).__name__) != NOT_SUPPORTED:
                continue
            value, default = getattr(obj, f.name), _default_of(type(obj), f)
            if _differs(value, default):
                reason = not_supported_reason(section, f.name, type(obj).__name__)
                why = f": {reason}" if reason else ""
                found.append(f"{section}.{f.name}={value!r} (supported: {default!r}){why}")
    return found


def check_supported(cfg: Any) -> None:
    """Raise NotSupportedError naming every not-supported field that is set to a non-default value."""
    found = unsupported_settings(cfg)
    if found:
        first = found[0].replace(" (supported:", " is not supported yet by longspan (supported:", 1)
        rest = f"; also: {'; '.join(found[1:])}" if len(found) > 1 else ""
        raise NotSupportedError(first + rest)


def _has_accelerator() -> bool:
    return torch.cuda.is_available()


# Device-dependent fields and the values that need an accelerator.
def _needs_accelerator(section: str, name: str, value: Any) -> bool:
    if (section, name) == ("dist", "distributed_backend"):
        return value == "nccl"
    if (section, name) == ("profiling", "memory_snapshot_path"):
        return False  # only meaningful with record_memory_history, which is reported itself
    if (section, name) == ("train", "empty_unused_memory_level"):
        return value != 0
    if (section, name) == ("logger", "log_energy"):
        return False  # needs energy counters, not an accelerator: setup() finds them and reports their absence
    if (section, name) == ("model", "cuda_graph_warmup_steps"):
        return False  # read only with enable_cuda_graph / external_cuda_graph, which are reported themselves
    if (section, name) == ("model", "pipeline_model_parallel_comm_backend"):
        return value == "nccl"  # 'ucc' runs on CPU too (when torch has it)
    if (section, name) == ("model", "attention_backend"):
        return value == "fused"  # the CUDA-only kernels; the other names map onto SDPA kernels everywhere
    if name.startswith("fp8"):
        return False  # not ignored: model.fp8 without FP8 hardware is a one-line error (parallel/float8.py)
    return bool(value)


def inapplicable_fields(cfg: Any) -> list[str]:
    """Settings the user made that have no effect here, as 'section.field=value' strings: device-dependent
    ones without an accelerator, and performance hints switched on. Defaults are never listed: a default that
    does not apply (nccl, pin_memory on a CPU machine) adapts silently."""
    accelerator = _has_accelerator()
    out = []
    for section, obj in _sections(cfg):
        for f in yaml_fields(obj):
            status = field_status(section, f.name)
            value = getattr(obj, f.name)
            if status in (HINT, DEVICE) and not _differs(value, _default_of(type(obj), f)):
                continue
            if status == HINT and value:
                out.append(f"{section}.{f.name}={value!r}")
            elif status == DEVICE and not accelerator and _needs_accelerator(section, f.name, value):
                out.append(f"{section}.{f.name}={value!r}")
    return out
