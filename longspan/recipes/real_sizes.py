"""What the real-size pretraining recipes of the family packages share: a standard decoder provider and the
pretraining container around it (bf16; mock data unless a data path is given)."""

from __future__ import annotations

import torch.nn.functional as F

from longspan.models.gpt_provider import GPTModelProvider
from longspan.peft import LoRA
from longspan.recipes.finetune import finetune_recipe
from longspan.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DistributedDataParallelConfig,
    GPTDatasetConfig,
    LoggerConfig,
    OptimizerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
)


def standard_decoder(**shape: object) -> GPTModelProvider:
    """A GPT provider with the standard decoder's choices (RMSNorm, SwiGLU, RoPE, no biases) and ``shape``."""
    defaults = dict(
        normalization="RMSNorm", activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False,
        position_embedding_type="rope", share_embeddings_and_output_weights=False, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, layernorm_epsilon=1e-5, make_vocab_size_divisible_by=128,
    )
    defaults.update(shape)
    return GPTModelProvider(**defaults)  # type: ignore[arg-type]


def pretrain_recipe(model: GPTModelProvider, name: str, tokenizer_model: str, *, gbs: int, lr: float,
                    min_lr: float, warmup_iters: int = 2000, train_iters: int = 1_168_251) -> ConfigContainer:
    """A pretraining run of ``model`` under runs/``name`` with the given batch and learning-rate schedule."""
    run_dir = f"runs/{name}"
    return ConfigContainer(
        model=model,
        train=TrainingConfig(micro_batch_size=1, global_batch_size=gbs, train_iters=train_iters,
                             eval_interval=2000, eval_iters=32, manual_gc=True, manual_gc_interval=100),
        optimizer=OptimizerConfig(optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=0.1, adam_beta1=0.9,
                                  adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, use_distributed_optimizer=True),
        ddp=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                          use_distributed_optimizer=True, average_in_collective=True),
        scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=warmup_iters, lr_warmup_init=0.0),
        dataset=GPTDatasetConfig(random_seed=1234, sequence_length=model.seq_length, split="9999,8,2",
                                 reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                                 num_workers=8),
        tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_model),
        logger=LoggerConfig(log_interval=10, tensorboard_dir=f"{run_dir}/tensorboard", log_throughput=True),
        checkpoint=CheckpointConfig(save=f"{run_dir}/checkpoints", load=f"{run_dir}/checkpoints",
                                    save_interval=2000),
        mixed_precision="bf16_mixed",
    )


def lora_finetune(model: GPTModelProvider, name: str) -> ConfigContainer:
    """The ``lora`` recipe on ``model`` (bf16): architecture, weights and tokenizer come from
    ``checkpoint.pretrained_checkpoint``; the shape lets ``longspan plan`` size the run without one."""
    cfg = finetune_recipe(name, lr=1e-4)
    cfg.model = model
    cfg.peft = LoRA()
    cfg.mixed_precision = "bf16_mixed"
    return cfg

