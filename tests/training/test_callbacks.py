"""Training callbacks (``longspan.training.callbacks``, Megatron Bridge's API): the events of a run in order, a
callback's stop request ending with a checkpoint that resumes bit for bit, Bridge's documentation examples, and a
failing callback or an unknown event as one line."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from longspan.cli import main as cli_main
from longspan.core.errors import ConfigError
from longspan.training.callbacks import (
    VALID_EVENTS,
    Callback,
    CallbackContext,
    CallbackError,
    CallbackManager,
    stop_requested,
)
from longspan.training.pretrain import pretrain
from tests.parallel.harness import get_shared_pool, init_gloo
from tests.training.pretrain_helpers import losses_by_iteration, tiniest_config

TRAIN_ITERS = 6


def _config(tmp_path: Path, name: str, **train_overrides: Any) -> Any:
    """6 iterations with dropout on (resuming must restore the dropout RNG), validation every 3 iterations on
    one batch, a checkpoint every 3, a test evaluation at the end."""
    cfg = tiniest_config(tmp_path, name, train_iters=TRAIN_ITERS, **train_overrides)
    cfg.train.eval_interval, cfg.train.eval_iters = 3, 1
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.1
    cfg.checkpoint.save_interval = 3
    return cfg


class Recorder(Callback):
    """Every event with the iteration count the context shows at that moment."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.events: list[tuple[str, int]] = []
        self.stop_after = stop_after

    def _record(self, name: str, context: Any) -> None:
        assert context.user_state is context.manager.user_state  # the one dict of the run
        context.user_state.setdefault("seen", 0)
        context.user_state["seen"] += 1
        self.events.append((name, context.state.train_state.step))


for _event in sorted(VALID_EVENTS):  # one override per event, each recording its own name
    setattr(Recorder, _event, (lambda name: lambda self, context: self._record(name, context))(_event))


def _on_train_step_end_stop(self: Recorder, context: Any) -> None:
    self._record("on_train_step_end", context)
    assert context.loss_dict and "lm loss" in context.loss_dict and context.optimizer is not None
    assert context.config is context.state.cfg
    if self.stop_after is not None and context.state.train_state.step + 1 == self.stop_after:
        context.request_stop()


Recorder.on_train_step_end = _on_train_step_end_stop


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run every other run here is compared with, its events recorded."""
    cfg = _config(tmp_path_factory.mktemp("cb"), "straight")
    recorder = Recorder()
    manager = CallbackManager()
    manager.add(recorder)
    order: list[str] = []
    manager.register("on_eval_end", lambda ctx: order.append(f"fn {sorted(ctx.total_loss_dict)}"))
    state = pretrain(cfg, callbacks=manager)
    return cfg, state, recorder.events, manager, order


def _iteration(step: int) -> list[tuple[str, int]]:
    return [("on_train_step_start", step), ("on_train_step_end", step)]


def _evaluation(phase: str, step: int) -> list[tuple[str, int]]:
    return [(f"on_{phase}_start", step), (f"on_{phase}_step_start", step), (f"on_{phase}_step_end", step),
            (f"on_{phase}_end", step)]


@pytest.mark.slow
def test_event_sequence_of_a_run_with_eval_test_and_two_saves(recorded_run) -> None:
    cfg, state, events, manager, order = recorded_run
    expected = [("on_data_init_start", 0), ("on_train_start", 0)]
    for step in range(TRAIN_ITERS):  # on_train_step_end sees the count before the step, as in Bridge
        expected += _iteration(step)
        if (step + 1) % 3 == 0:  # validation, then the interval checkpoint
            expected += _evaluation("eval", step + 1) + [("on_checkpoint_save", step + 1)]
    expected += [("on_train_end", TRAIN_ITERS)] + _evaluation("test", TRAIN_ITERS)
    assert events == expected
    assert manager.user_state["seen"] == len(expected)
    assert order == ["fn ['lm loss']"] * 2  # the function form fires too, after the class's method (registered first)
    assert state.train_state.step == TRAIN_ITERS
    assert sorted(p.name for p in Path(cfg.checkpoint.save).glob("iter_*")) == ["iter_0000003", "iter_0000006"]


@pytest.mark.slow
def test_stop_request_ends_with_a_checkpoint_that_resumes_bit_for_bit(tmp_path: Path, recorded_run) -> None:
    reference = losses_by_iteration(recorded_run[0])
    recorder = Recorder(stop_after=4)  # not a save interval: the checkpoint at 4 is the stop's
    state = pretrain(_config(tmp_path, "stopped"), callbacks=[recorder])
    assert state.train_state.step == 4
    root = Path(state.cfg.checkpoint.save)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert recorder.events[-3:] == [("on_train_step_end", 3), ("on_checkpoint_save", 4), ("on_train_end", 4)]
    assert not any(name.startswith("on_test") for name, _ in recorder.events)  # an early exit skips the test set

    resumed_cfg = _config(tmp_path, "stopped")  # the same directories: continues from iteration 4
    pretrain(resumed_cfg)
    resumed = losses_by_iteration(resumed_cfg)
    assert [resumed[i] for i in range(1, TRAIN_ITERS + 1)] == [reference[i] for i in range(1, TRAIN_ITERS + 1)]


# Megatron Bridge's callback documentation (docs/training/callbacks.md and the callbacks API page,
# NVIDIA-NeMo/Megatron-Bridge): the class-based, functional, mixed and user-state examples in their shape; only the
# import lines differ (megatron.bridge.training.X -> longspan.training.X). The functional example's
# `from megatron.bridge.training import pretrain` names the module in Bridge (its training/__init__.py is empty),
# so both forms import the function from its module, as the class-based example does.
@pytest.mark.slow
def test_bridge_documentation_examples_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from longspan.training.callbacks import Callback, CallbackManager  # noqa: F811 - the documentation's imports
    from longspan.training.forward_step import forward_step as forward_step_func  # Bridge: training.gpt_step
    from longspan.training.pretrain import pretrain  # noqa: F811

    class MyCallback(Callback):
        def on_train_start(self, context):
            context.user_state['start_time'] = time.time()
            print(f"Training started at step {context.state.train_state.step}")

        def on_train_step_end(self, context):
            if context.loss_dict:
                print(f"Step {context.state.train_state.step}: loss={context.loss_dict}")

        def on_train_end(self, context):
            elapsed = time.time() - context.user_state['start_time']
            print(f"Training completed in {elapsed:.2f}s")

    class StepCounterCallback(Callback):
        def on_train_start(self, context):
            context.user_state['callback_step_count'] = 0

        def on_train_step_end(self, context):
            context.user_state['callback_step_count'] += 1

        def on_train_end(self, context):
            print(f"Callback saw {context.user_state['callback_step_count']} steps")

    def log_step(context):
        step = context.state.train_state.step
        if context.loss_dict:
            print(f"Step {step}: {context.loss_dict}")

    config = tiniest_config(tmp_path, "class", train_iters=2)
    pretrain(config, forward_step_func, callbacks=[MyCallback(), StepCounterCallback()])
    out = capsys.readouterr().out
    assert "Training started at step 0" in out and "Step 1: loss={'lm loss': tensor(" in out
    assert "Training completed in" in out and "Callback saw 2 steps" in out

    manager = CallbackManager()
    manager.register("on_train_step_end", log_step)
    manager.register("on_train_end", lambda ctx: print("Training complete!"))
    config = tiniest_config(tmp_path, "functional", train_iters=2)
    pretrain(config, forward_step_func, callbacks=manager)
    out = capsys.readouterr().out
    assert "Step 0: {'lm loss': tensor(" in out and "Step 1: {'lm loss'" in out and "Training complete!" in out
    assert manager.has_callbacks("on_train_step_end") and len(manager.list_callbacks("on_train_step_end")) == 1
    assert manager.events == VALID_EVENTS


class FailingCallback(Callback):
    """Raises at the end of the third iteration (after the checkpoint of iteration 2)."""

    def on_train_step_end(self, context):
        if context.state.train_state.step == 2:
            raise ValueError("the metrics service is down\nsecond line")


@pytest.mark.slow
def test_failing_callback_from_the_cli_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tiniest_config(tmp_path, "cli", train_iters=4)
    cfg.checkpoint.save_interval = 2
    cfg.to_yaml(tmp_path / "run.yaml")
    code = cli_main(["pretrain", "--config", str(tmp_path / "run.yaml"),
                     "--callbacks", f"{__name__}:FailingCallback"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["longspan: error: callback FailingCallback.on_train_step_end failed in on_train_step_end: "
                   "ValueError: the metrics service is down"]
    root = Path(cfg.checkpoint.save)  # the checkpoint of iteration 2 is whole; nothing of iteration 3 was written
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("iter_")) == ["iter_0000002"]


def test_a_python_caller_gets_the_callbacks_own_error_as_the_cause() -> None:
    manager = CallbackManager()
    manager.add(FailingCallback())
    context = CallbackContext(state=SimpleNamespace(train_state=SimpleNamespace(step=2)), model=[])
    with pytest.raises(CallbackError, match="^callback FailingCallback.on_train_step_end failed") as info:
        manager.fire("on_train_step_end", context)
    assert isinstance(info.value.__cause__, ValueError)  # the traceback into the callback is kept


def test_bad_callback_arguments_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    manager = CallbackManager()
    with pytest.raises(ConfigError, match=r"^callbacks: unknown event 'on_train_stop'; valid events: on_checkpoint"):
        manager.register("on_train_stop", print)
    with pytest.raises(ConfigError, match="unknown event 'on_step_end'"):
        manager.add("on_step_end", print)
    with pytest.raises(ConfigError, match="is not a Callback"):
        pretrain(tiniest_config(tmp_path, "bad"), callbacks=[print])
    assert cli_main(["pretrain", "--recipe", "tiny", "--callbacks", "no_such_module_here:Thing"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "longspan: error: --callbacks no_such_module_here:Thing: cannot import module 'no_such_module_here'"]


def _stop_agreed(requesting_rank: int) -> bool:
    init_gloo(timeout_s=60)
    manager = CallbackManager()
    if dist.get_rank() == requesting_rank:
        manager.request_stop()
    return stop_requested(SimpleNamespace(callback_manager=manager, device=torch.device("cpu")))


@pytest.mark.slow
def test_one_ranks_stop_request_stops_every_rank() -> None:
    assert get_shared_pool(2).run(_stop_agreed, 1) == [True, True]  # rank 0 alone would read False
