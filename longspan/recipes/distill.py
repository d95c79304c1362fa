"""``distill``: a student half the ``tiny`` model's size, on tiny's data and tokenizer, for ``longspan distill``.

The teacher comes from the command line (``--teacher DIR``): a ``tiny`` run's checkpoint shares the student's
tokenizer and vocabulary out of the box (``longspan pretrain --recipe tiny``, then ``longspan distill --teacher
runs/tiny/checkpoints``); an HF teacher needs its own tokenizer given to the student
(``tokenizer.tokenizer_model=DIR``), as the KL compares the two vocabularies token by token.
"""

from __future__ import annotations

from longspan.recipes.tiny import tiny
from longspan.training.config import ConfigContainer

RUN_DIR = "runs/distill"


def distill_student() -> ConfigContainer:
    """tiny's config with 2 layers of hidden 64 (4 heads / 2 query groups, FFN 256), saved under runs/distill."""
    cfg = tiny()
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups = 2, 64, 256, 4, 2
    cfg.logger.tensorboard_dir = f"{RUN_DIR}/tensorboard"
    cfg.checkpoint.save = cfg.checkpoint.load = f"{RUN_DIR}/checkpoints"
    return cfg
