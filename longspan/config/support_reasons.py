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
