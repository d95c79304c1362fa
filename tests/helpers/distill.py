"""What the distillation tests share: a tiny HF teacher directory and the tiny student's distillation config."""

from __future__ import annotations

import json
import os
from typing import Any


def write_teacher(directory: str, vocab_size: int = 256) -> str:
    """A tiny HF Llama teacher (hidden 48, 2 layers, 4 heads / 2 KV heads) over the NullTokenizer's padded
    vocabulary (256); a large init and uneven norm weights make its distributions peaked and every tensor count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=False))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    hf.save_pretrained(directory)
    return directory


def distill_config(run_dir: str, teacher: str, iters: int = 8, tp: int = 1, pp: int = 1, cp: int = 1,
                   fsdp2: bool = False, hidden: int = 32, **kd_fields: Any) -> Any:
    """The tiny student (2 layers, hidden ``hidden``) distilled from the HF directory ``teacher``: mock data of 32
    tokens, global batch 4 in microbatches of 2, ``iters`` iterations logged to ``run_dir``/tb; ``kd_fields`` are
    ``ModelOptDistillConfig``'s."""
    from longspan.recipes import get_recipe
    from longspan.training.distill import ModelOptDistillConfig, convert_to_distillation_provider, teacher_provider_from
    from tests.training.pretrain_helpers import mock_layout_run

    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups = 2, hidden, 64, 4, 2
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size = tp, pp, cp
    cfg.dist.use_torch_fsdp2 = fsdp2
    mock_layout_run(cfg, f"{run_dir}/tb", 32, 2, 4, iters)
    convert_to_distillation_provider(m, teacher_provider_from(teacher), ModelOptDistillConfig(**kd_fields),
                                     teacher_checkpoint=teacher)
    return cfg


KEYS = ("lm loss", "logits distillation loss", "intermediate distillation loss", "total loss")


def logged(run_dir: str) -> dict:
    """Per-iteration LM loss, KL, total loss and gradient norm of ``run_dir``/tb/metrics.jsonl."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "tb", "metrics.jsonl"))]
    rows = [r for r in rows if r.get("phase") == "train"]
    out = {key: [r["losses"][key] for r in rows] for key in KEYS if key in rows[0]["losses"]}
    out["grad norm"] = [r["grad_norm"] for r in rows]
    out["iterations"] = [r["iteration"] for r in rows]
    return out
