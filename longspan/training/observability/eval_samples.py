"""Sample generations at evaluation (``logger.log_eval_samples``, longspan's own field).

At each evaluation the prompts of the first N validation samples are continued greedily with
``longspan.inference.generate`` and logged as text: one console line per sample, TensorBoard ``add_text``, a W&B
Table, an MLflow text artifact, Comet ``log_text`` and a ``phase: eval_samples`` record in metrics.jsonl.

The prompt of a sample whose loss mask starts at 0 (SFT) is its tokens up to the first answer token; otherwise
(pretraining) its first ``eval_samples_prompt_tokens`` tokens. Generation never touches the training streams:
decoding is greedy (nothing is drawn), the model runs in eval mode (no dropout), the validation iterator is not
read (samples come from the dataset by index) and the RNG states of Python, NumPy and torch are restored anyway.

Where every rank holds the whole model (one process, DDP) the logging rank generates alone, with a KV cache.
Where parameters are sharded (tensor parallel, FSDP2 / the distributed optimizer) every rank runs the same
greedy decoding (``generate(..., collective=True)``: the whole sequence each step, the tensor-parallel output
layer gathers the logits) and the logging rank writes. Pipeline, context and expert parallelism and sequence
parallelism are refused by the config rules as not supported yet (``config.rules.infra.check_eval_samples_layout``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from longspan.core.logging import get_logger, is_last_rank, print_rank_last
from longspan.inference import generate
from longspan.training.state import GlobalState

logger = get_logger(__name__)

TEXT_TAG = "eval samples"


@dataclass
class EvalSample:
    """One validation prompt and the model's greedy continuation of it."""

    index: int
    """The validation sample's index."""
    prompt: str
    """The prompt, detokenized."""
    generation: str
    """The continuation, detokenized (without the EOS token that stopped it)."""
    finish_reason: str
    """``"eos"`` or ``"length"``."""
    prompt_tokens: int = 0
    """The prompt's length in tokens."""
    generated_tokens: int = 0
    """How many tokens were generated (an EOS that stopped generation included)."""


def prompt_ids(sample: dict[str, Any], prompt_tokens: int) -> list[int]:
    """The prompt of one dataset sample: up to the first answer token when the loss mask starts at 0, else
    the first ``prompt_tokens`` tokens."""
    tokens = torch.as_tensor(sample["tokens"]).reshape(-1)
    mask = sample.get("loss_mask")
    if mask is not None:
        mask = torch.as_tensor(mask).reshape(-1)
        if mask.numel() and float(mask[0]) == 0.0:
            answer = torch.nonzero(mask > 0)
            if answer.numel():  # loss_mask[j] scores tokens[j + 1]: the prompt ends at position j
                return [int(t) for t in tokens[: int(answer[0]) + 1]]
    return [int(t) for t in tokens[:prompt_tokens]]


@contextlib.contextmanager
def preserved_rng_state() -> Iterator[None]:
    """Restore the Python, NumPy and torch (CPU and accelerator) generators afterwards."""
    python_state, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def is_sharded(model: Sequence[torch.nn.Module]) -> bool:
    """Whether the model's parameters are DTensors (tensor parallel, FSDP2): then every rank must generate."""
    from torch.distributed.tensor import DTensor  # slow to import; already loaded wherever a DTensor exists

    return any(isinstance(p, DTensor) for chunk in model for p in chunk.parameters())


def generate_eval_samples(model: Sequence[torch.nn.Module], tokenizer: Any, dataset: Any, count: int,
                          max_new_tokens: int, prompt_tokens: int, max_positions: Optional[int],
                          collective: bool = False) -> list[EvalSample]:
    """Greedy continuations of the prompts of the first ``count`` samples of ``dataset`` (``collective``: every
    rank of a sharded model calls this with the same arguments)."""
    samples = []
    with preserved_rng_state():
        for index in range(min(count, len(dataset))):
            ids = prompt_ids(dataset[index], prompt_tokens)
            if max_positions is not None and len(ids) + max_new_tokens > max_positions:
                ids = ids[-max(1, max_positions - max_new_tokens):]  # the end of the prompt leads to the answer
            result = generate(model, tokenizer, ids, max_new_tokens=max_new_tokens, temperature=0.0,
                              collective=collective)
            samples.append(EvalSample(index, tokenizer.detokenize(ids), result.text, result.finish_reason, len(ids),
                                      len(result.output_ids)))
    return samples


def log_eval_samples(state: GlobalState, model: Sequence[torch.nn.Module], iteration: int) -> list[EvalSample]:
    """The evaluation hook: generate (on the logging rank, or on every rank of a sharded model) and write to
    every sink from the logging (last) rank; returns the samples (empty where nothing was generated)."""
    cfg = state.cfg
    count = cfg.logger.log_eval_samples
    dataset = state.valid_dataset
    if not count:
        return []
    if dataset is None or len(dataset) == 0:  # the same on every rank: the datasets are global
        print_rank_last("logger.log_eval_samples: no validation dataset to take prompts from; skipped", logger)
        return []
    collective = is_sharded(model)
    if not (collective or is_last_rank()):
        return []
    learned = cfg.model.position_embedding_type == "learned_absolute"
    samples = generate_eval_samples(
        model, state.tokenizer, dataset, count, cfg.logger.eval_samples_max_new_tokens,
        cfg.logger.eval_samples_prompt_tokens, cfg.model.seq_length if learned else None, collective)
    if is_last_rank():
        _write(state, samples, iteration)
    return samples


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def _write(state: Any, samples: list[EvalSample], iteration: int) -> None:
    for s in samples:
        print_rank_last(f"eval sample {s.index} at iteration {iteration}: {_short(s.prompt)!r} -> "
                        f"{s.generation!r} ({s.finish_reason})", logger)
    rows = [[iteration, s.index, s.prompt, s.generation, s.finish_reason] for s in samples]
    tb = state.tensorboard_logger
    if tb is not None:
        table = "| sample | prompt | generation |\n| --- | --- | --- |\n" + "\n".join(
            f"| {s.index} | {_markdown(s.prompt)} | {_markdown(s.generation)} |" for s in samples)
        tb.add_text(TEXT_TAG, table, iteration)
    wandb = state.wandb_logger
    if wandb is not None:
        columns = ["iteration", "sample", "prompt", "generation", "finish_reason"]
        wandb.log({TEXT_TAG: wandb.Table(columns=columns, data=rows)}, step=iteration)
    text = "\n\n".join(f"[sample {s.index}] {s.prompt}\n=> {s.generation}" for s in samples)
    mlflow = state.mlflow_logger
    if mlflow is not None:
        mlflow.log_text(text, f"eval_samples/iteration_{iteration:07d}.txt")
    comet = state.comet_logger
    if comet is not None:
        comet.log_text(text, step=iteration)
    metrics = state.metrics_logger
    if metrics is not None:
        metrics.write({"phase": "eval_samples", "iteration": iteration,
                       "samples": [dataclasses.asdict(s) for s in samples]})


def _markdown(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
