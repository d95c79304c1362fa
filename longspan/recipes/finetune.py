"""Finetuning recipes: ``sft`` (full finetune), ``lora`` and ``dora`` (adapters on a frozen base).

The model is the pretrained checkpoint's: ``checkpoint.pretrained_checkpoint`` names a Hugging Face model
directory (architecture from its config.json, tokenizer from its files) or a longspan checkpoint (architecture
and tokenizer from its run_config.yaml and saved tokenizer files, through ``checkpoint.use_checkpoint_args``).
The data is a ``FinetuningDatasetConfig`` directory (``training.jsonl``, ``validation.jsonl``), so the whole
command is::

    longspan finetune --recipe lora checkpoint.pretrained_checkpoint=HF_DIR dataset.dataset_root=DATA_DIR

Hyperparameters follow Megatron Bridge's finetuning recipes (cosine decay to zero after a short warmup; LoRA
at 1e-4, a full finetune at 5e-6), scaled to batches a single machine can run; override any of them.
"""

from __future__ import annotations

from longspan.models.gpt_provider import GPTModelProvider
from longspan.peft import DoRA, LoRA
from longspan.recipes.tiny import tiny
from longspan.training.config import (
    CheckpointConfig,
    ConfigContainer,
    FinetuningDatasetConfig,
    LoggerConfig,
    OptimizerConfig,
    RNGConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
)

SEQ_LENGTH = 2048


def _placeholder_model() -> GPTModelProvider:
    model = tiny().model
    model.seq_length = SEQ_LENGTH
    return model


def finetune_recipe(name: str, lr: float) -> ConfigContainer:
    """The finetuning run every finetuning recipe starts from (its model is replaced by the pretrained one)."""
    run_dir = f"runs/{name}"
    return ConfigContainer(
        rng=RNGConfig(seed=1234),
        # Replaced by the pretrained checkpoint's architecture at start-up; only the layout, precision and
        # sequence length set here are kept. The placeholder is tiny's shape, so the recipe validates as it is.
        model=_placeholder_model(),
        train=TrainingConfig(micro_batch_size=1, global_batch_size=8, train_iters=1000, eval_interval=100,
                             eval_iters=8),
        optimizer=OptimizerConfig(optimizer="adam", lr=lr, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9,
                                  adam_beta2=0.98, adam_eps=1e-8, clip_grad=1.0),
        scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=50, lr_warmup_init=0.0),
        # The sequence length is the model's (the recipe's for HF models, the checkpoint's for longspan ones).
        dataset=FinetuningDatasetConfig(num_workers=0, do_test=False),
        # No tokenizer type: the pretrained checkpoint's tokenizer is used.
        tokenizer=TokenizerConfig(),
        logger=LoggerConfig(log_interval=10, tensorboard_dir=f"{run_dir}/tensorboard"),
        checkpoint=CheckpointConfig(save=f"{run_dir}/checkpoints", load=f"{run_dir}/checkpoints",
                                    save_interval=100, use_checkpoint_args=True),
    )


def sft() -> ConfigContainer:
    """Full-parameter supervised finetuning of the pretrained checkpoint (lr 5e-6)."""
    return finetune_recipe("sft", lr=5e-6)


def lora() -> ConfigContainer:
    """LoRA (Megatron Bridge's defaults: rank 32, alpha 32, on linear_qkv/proj/fc1/fc2) on a frozen base (lr 1e-4)."""
    cfg = finetune_recipe("lora", lr=1e-4)
    cfg.peft = LoRA()
    return cfg


def dora() -> ConfigContainer:
    """DoRA (Megatron Bridge's defaults: rank 32, alpha 64) on a frozen base (lr 1e-4)."""
    cfg = finetune_recipe("dora", lr=1e-4)
    cfg.peft = DoRA()
    return cfg
