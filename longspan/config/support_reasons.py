"""Why each field longspan does not support stays so: one line per field, shown in docs/config-support.md and at
the end of the NotSupportedError (longspan.config.support reads it).

Keys are "section.field" (every class of the section) or "ClassName.field" (that class only; looked up first).
"""

from __future__ import annotations

from longspan.config.rules.model import MAMBA_NOT_SUPPORTED_REASONS, T5_NOT_SUPPORTED_REASONS

# The checkpoint, optimizer and ddp fields.
CHECKPOINT_OPTIM_DDP_REASONS: dict[str, str] = {
    "checkpoint.strict_fsdp_dtensor_load": "applies to Megatron-FSDP's fsdp_dtensor checkpoints; longspan writes "
                                           "torch_dist (DCP), whose mismatches checkpoint.dist_ckpt_strictness handles",
    "ddp.use_megatron_fsdp": "Megatron's own FSDP implementation; longspan shards with PyTorch FSDP2 "
                             "(dist.use_torch_fsdp2, ddp.data_parallel_sharding_strategy)",
    "ddp.use_custom_fsdp": "deprecated name of use_megatron_fsdp: longspan shards with PyTorch FSDP2",
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
    "model.scatter_embedding_sequence_parallel": "sequence parallel here is a DTensor plan that always shards the embedding output",
    "model.use_ring_exchange_p2p": "needs a custom PyTorch build with ring_exchange; torch pipelining uses batched isend/irecv",
    "dataset.object_storage_cache_path": "data paths are local files; object-storage reading is not built",
    "HFDatasetSourceConfig.dataset_name": "Bridge's named Hub presets need the Hub; give path_or_dataset and schema_adapter",
    "tokenizer.tokenizer_prompt_format": "multimodal prompt formats belong to Megatron's VLM tokenizers, not built here",
    "tokenizer.image_tag_type": "multimodal image tags belong to Megatron's VLM tokenizers, not built here",
    "dist.lazy_init": "Megatron's deferred init for external launchers; longspan initializes at start-up",
    "dist.use_sharp": "NCCL CollNet/SHARP reads its environment when a communicator starts; longspan's are not set up for it",
    "dist.enable_megatron_core_experimental": "switches Megatron Core experimental code, which longspan does not run",
    "straggler.straggler_ctrlr_port": "the straggler detector cannot be switched at run time through a port",
}

# Vision-language models: the layouts their plans do not cover yet.
_VLM_SPLIT = ("the vision-language pipeline split puts the vision tower on the first stage and the language model's "
              "layers evenly; uneven and virtual splits are not built for it")
_VLM_NO_MTP = "multi-token prediction is a DeepSeek/GLM GPT head; the vision-language models have none"
for _vlm in ("Qwen25VLModelProvider", "Gemma3VLModelProvider"):
    NOT_SUPPORTED_REASONS.update({
        f"{_vlm}.sequence_parallel": ("image embeddings are merged into the whole-sequence token embeddings; the "
                                      "sequence-parallel split after that merge is not built for vision-language models"),
        f"{_vlm}.context_parallel_size": ("an image's tokens (and their positions) must stay on one rank; the "
                                          "context-parallel split is not built for vision-language models"),
        f"{_vlm}.virtual_pipeline_model_parallel_size": _VLM_SPLIT,
        f"{_vlm}.num_layers_in_first_pipeline_stage": _VLM_SPLIT,
        f"{_vlm}.num_layers_in_last_pipeline_stage": _VLM_SPLIT,
        f"{_vlm}.account_for_embedding_in_pipeline_split": _VLM_SPLIT,
        f"{_vlm}.account_for_loss_in_pipeline_split": _VLM_SPLIT,
        f"{_vlm}.mtp_num_layers": _VLM_NO_MTP,
        f"{_vlm}.mtp_loss_scaling_factor": _VLM_NO_MTP,
    })
NOT_SUPPORTED_REASONS.update({
    "Qwen25VLModelProvider.expert_model_parallel_size": "Qwen2.5-VL's language model is dense: it has no experts",
    "Qwen25VLModelProvider.expert_tensor_parallel_size": "Qwen2.5-VL's language model is dense: it has no experts",
    "Gemma3VLModelProvider.mtp_enabled": _VLM_NO_MTP,
    "MambaProvider.mtp_loss_scaling_factor": "multi-token prediction depths are built for GPTModel only",
})

# The model families' own reasons live beside their checks (config.rules.model); the checkpoint, optimizer and
# ddp ones above.
NOT_SUPPORTED_REASONS.update(T5_NOT_SUPPORTED_REASONS)
NOT_SUPPORTED_REASONS.update({f"MambaProvider.{name}": why for name, (_, why) in MAMBA_NOT_SUPPORTED_REASONS.items()})
NOT_SUPPORTED_REASONS.update(CHECKPOINT_OPTIM_DDP_REASONS)
