"""logger.log_eval_samples: greedy continuations of validation prompts at each evaluation, logged as text."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from longspan.core.errors import NotSupportedError
from longspan.inference import generate
from longspan.config.rules.infra import check_eval_samples_layout
from longspan.training.observability.eval_samples import (
    EvalSample,
    _write,
    prompt_ids,
)
from longspan.training.pretrain import pretrain
from tests.training.pretrain_helpers import losses_by_iteration, small_config


def _records(cfg, phase: str) -> list[dict]:
    path = Path(cfg.logger.tensorboard_dir) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("phase") == phase]


def _run(tmp_path: Path, name: str, samples: int):
    cfg = small_config(tmp_path, name, train_iters=6, eval_interval=2, eval_iters=1)
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.1  # training draws from torch's generator
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.log_eval_samples = samples
    cfg.logger.eval_samples_max_new_tokens = 5
    cfg.logger.eval_samples_prompt_tokens = 7
    pretrain(cfg)
    return cfg


def test_losses_with_sample_generation_equal_losses_without_bit_for_bit(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    off = _run(tmp_path, "off", 0)
    on = _run(tmp_path, "on", 2)
    assert losses_by_iteration(on) == losses_by_iteration(off)  # exact float equality, every iteration
    assert [r["losses"] for r in _records(on, "validation")] == [r["losses"] for r in _records(off, "validation")]
    assert _records(off, "eval_samples") == []
    records = _records(on, "eval_samples")
    assert [r["iteration"] for r in records] == [2, 4, 6]
    assert all(len(r["samples"]) == 2 and [s["index"] for s in r["samples"]] == [0, 1] for r in records)
    # eval_samples_prompt_tokens=7 (pretraining data) and eval_samples_max_new_tokens=5
    assert {(s["prompt_tokens"], s["generated_tokens"]) for r in records for s in r["samples"]} == {(7, 5)}
    lines = [m for m in capsys.readouterr().out.splitlines() if m.startswith("eval sample ")]
    assert len(lines) == 6 and lines[0].startswith("eval sample 0 at iteration 2: ")
    tb_files = list(Path(on.logger.tensorboard_dir).glob("events.out.tfevents.*"))
    assert tb_files and any(b"eval samples" in f.read_bytes() for f in tb_files)  # TensorBoard add_text


def test_prompt_is_the_sft_prompt_or_the_first_tokens() -> None:
    sft = {"tokens": torch.tensor([5, 6, 7, 8, 9, 10]), "loss_mask": torch.tensor([0., 0., 1., 1., 0., 0.])}
    assert prompt_ids(sft, prompt_tokens=2) == [5, 6, 7]  # loss_mask[2] scores token 8, the first answer token
    text = {"tokens": torch.arange(10), "loss_mask": torch.ones(10)}
    assert prompt_ids(text, prompt_tokens=4) == [0, 1, 2, 3]


def test_the_samples_are_longspans_greedy_generations(tmp_path: Path) -> None:
    from longspan.data.tokenizers import build_tokenizer
    from longspan.models.builder import build_meta_model
    from longspan.training.observability.eval_samples import generate_eval_samples

    cfg = small_config(tmp_path)
    cfg.model.vocab_size = 256
    torch.manual_seed(0)
    model = build_meta_model(cfg.model).to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    tokenizer = build_tokenizer(cfg.tokenizer)
    dataset = [{"tokens": torch.arange(3, 40), "loss_mask": torch.ones(37)},
               {"tokens": torch.arange(50, 70), "loss_mask": torch.tensor([0.] * 5 + [1.] * 15)}]
    state = torch.get_rng_state()
    samples = generate_eval_samples([model], tokenizer, dataset, 3, max_new_tokens=4, prompt_tokens=6,
                                    max_positions=None)
    assert torch.equal(torch.get_rng_state(), state)
    assert len(samples) == 2
    assert samples[0].generation == generate(model, tokenizer, list(range(3, 9)), max_new_tokens=4).text
    assert samples[1].prompt == tokenizer.detokenize(list(range(50, 56)))


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def test_every_sink_gets_the_text() -> None:
    tb, wandb, mlflow, comet, metrics = _Recorder(), _Recorder(), _Recorder(), _Recorder(), _Recorder()
    wandb.Table = lambda columns, data: ("table", tuple(columns), tuple(map(tuple, data)))
    state = SimpleNamespace(tensorboard_logger=tb, wandb_logger=wandb, mlflow_logger=mlflow, comet_logger=comet,
                            metrics_logger=metrics)
    _write(state, [EvalSample(0, "a | b", "c", "length")], 10)
    (name, (tag, text, step), _), = tb.calls
    assert (name, tag, step) == ("add_text", "eval samples", 10) and "a \\| b" in text
    (name, (logged,), kwargs), = wandb.calls
    assert name == "log" and kwargs == {"step": 10}
    assert logged["eval samples"] == ("table", ("iteration", "sample", "prompt", "generation", "finish_reason"),
                                      ((10, 0, "a | b", "c", "length"),))
    (name, (text, artifact), _), = mlflow.calls
    assert name == "log_text" and artifact == "eval_samples/iteration_0000010.txt" and "a | b" in text
    assert comet.calls[0][0] == "log_text" and comet.calls[0][2] == {"step": 10}
    assert metrics.calls[0][1][0]["samples"][0]["generation"] == "c"


@pytest.mark.parametrize("field,value", [("pipeline_model_parallel_size", 2), ("context_parallel_size", 2),
                                         ("sequence_parallel", True)])
def test_unsupported_layouts_say_not_supported_yet(tmp_path: Path, field: str, value) -> None:
    cfg = small_config(tmp_path)
    cfg.logger.log_eval_samples = 2
    cfg.model.tensor_model_parallel_size = 2  # supported (tests/parallel/test_eval_samples_layouts.py)
    setattr(cfg.model, field, value)
    with pytest.raises(NotSupportedError) as info:
        check_eval_samples_layout(cfg)
    message = str(info.value)
    assert "logger.log_eval_samples=2 is not supported yet" in message and f"model.{field}={value}" in message
    assert "\n" not in message
    cfg.logger.log_eval_samples = 0
    check_eval_samples_layout(cfg)  # off: any layout


def test_the_rule_runs_in_validate(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    cfg.logger.log_eval_samples = 2
    cfg.model.pipeline_model_parallel_size = 2
    with pytest.raises(NotSupportedError, match="log_eval_samples=2 is not supported yet"):
        cfg.validate(world_size=2)


def test_collective_generation_is_greedy_only(tmp_path: Path) -> None:
    from longspan.core.errors import ConfigError

    with pytest.raises(ConfigError, match="collective generation is greedy only"):
        generate(torch.nn.Linear(2, 2), None, [1], temperature=0.5, collective=True)
