"""``tiny-t5``: a small T5 (encoder-decoder, span corruption) that trains on a CPU in minutes (builtin corpus).

Same tokenizer (plus 100 sentinel tokens, ``tokenizer.vocab_extra_ids``), optimizer and schedule as ``tiny``;
the data are T5 span-corruption samples of the builtin corpus (``T5MaskedWordPieceDatasetConfig``). Heads, FFN
and the padded vocabulary divide by 2 and 4 for tensor parallel; the output layer is untied for the same reason.
"""

from __future__ import annotations

from longspan.models.activations import gelu_tanh
from longspan.models.t5_provider import T5ModelProvider
from longspan.recipes.tiny import tiny
from longspan.training.config import ConfigContainer, T5MaskedWordPieceDatasetConfig

ENCODER_LENGTH = 128
DECODER_LENGTH = 64
RUN_DIR = "runs/tiny-t5"


def tiny_t5() -> ConfigContainer:
    """2 encoder + 2 decoder layers, hidden 128, 4 heads of 32, gated-gelu FFN 256, relative positions (T5 v1.1
    style: RMSNorm, no biases, unscaled attention), encoder 128 / decoder 64 tokens, fp32, no dropout."""
    cfg = tiny()
    cfg.model = T5ModelProvider(
        num_layers=2,
        encoder_num_layers=2,
        hidden_size=128,
        ffn_hidden_size=256,
        num_attention_heads=4,
        kv_channels=32,
        softmax_scale=1.0,
        seq_length=ENCODER_LENGTH,
        seq_length_dec=DECODER_LENGTH,
        max_position_embeddings=ENCODER_LENGTH,
        vocab_size=None,  # the tokenizer's, with its sentinels
        make_vocab_size_divisible_by=128,
        position_embedding_type="relative",
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=gelu_tanh,
        add_bias_linear=False,
        share_embeddings_and_output_weights=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
    )
    cfg.dataset = T5MaskedWordPieceDatasetConfig(
        random_seed=1234,
        sequence_length=ENCODER_LENGTH,
        sequence_length_decoder=DECODER_LENGTH,
        data_path="builtin:stdlib",
        split="969,30,1",
        num_workers=0,
    )
    cfg.tokenizer.vocab_extra_ids = 100
    cfg.optimizer.lr = 1e-3
    cfg.optimizer.min_lr = 1e-4
    cfg.logger.tensorboard_dir = f"{RUN_DIR}/tensorboard"
    cfg.checkpoint.save = f"{RUN_DIR}/checkpoints"
    cfg.checkpoint.load = f"{RUN_DIR}/checkpoints"
    return cfg
