"""``tiny``: a small Llama-style GPT that trains on a CPU in minutes, on text that ships with Python.

Shapes divide by 4 (layers, heads, query groups, FFN, padded vocabulary) and the global batch is 8
microbatches at dp=1, so every tensor/data parallel layout up to 4 ranks can split it and match it exactly.
"""

from __future__ import annotations

import torch.nn.functional as F

from longspan.models.gpt_provider import GPTModelProvider
from longspan.training.config import (
    CheckpointConfig,
    ConfigContainer,
    GPTDatasetConfig,
    LoggerConfig,
    OptimizerConfig,
    RNGConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
)

SEQ_LENGTH = 256
RUN_DIR = "runs/tiny"


def tiny() -> ConfigContainer:
    """4 layers, hidden 128, 8 heads / 4 query groups, SwiGLU, RoPE, RMSNorm, fp32, no dropout."""
    model = GPTModelProvider(
        num_layers=4,
        hidden_size=128,
        ffn_hidden_size=512,
        num_attention_heads=8,
        num_query_groups=4,
        seq_length=SEQ_LENGTH,
        vocab_size=4096,
        make_vocab_size_divisible_by=128,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        position_embedding_type="rope",
        rotary_base=10000,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        share_embeddings_and_output_weights=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=0.02,
    )
    return ConfigContainer(
        rng=RNGConfig(seed=1234),
        model=model,
        train=TrainingConfig(
            micro_batch_size=2,
            global_batch_size=16,
            train_iters=200,
            eval_interval=50,
            eval_iters=4,
        ),
        optimizer=OptimizerConfig(
            optimizer="adam",
            lr=3e-3,
            min_lr=3e-4,
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-8,
            clip_grad=1.0,
        ),
        scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_fraction=0.05),
        dataset=GPTDatasetConfig(
            random_seed=1234,
            sequence_length=SEQ_LENGTH,
            data_path="builtin:stdlib",
            split="969,30,1",
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            num_workers=0,
        ),
        tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="builtin:stdlib"),
        logger=LoggerConfig(log_interval=5, tensorboard_dir=f"{RUN_DIR}/tensorboard"),
        checkpoint=CheckpointConfig(
            save=f"{RUN_DIR}/checkpoints",
            load=f"{RUN_DIR}/checkpoints",
            save_interval=100,
        ),
    )
