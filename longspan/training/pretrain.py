"""``pretrain(config, forward_step_func, callbacks=None)``: Megatron Bridge's entry point."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from longspan.config.schema.container import ConfigContainer
from longspan.core.errors import NotSupportedError
from longspan.core.logging import get_logger
from longspan.models.attention_backend import attention_backend_context
from longspan.models.t5_provider import T5ModelProvider
from longspan.training.callbacks import Callback, CallbackManager, normalize_callbacks
from longspan.training.eval import evaluate_and_print_results
from longspan.training.step.forward_step import forward_step as default_forward_step
from longspan.training.setup import setup
from longspan.training.step.t5_forward_step import t5_forward_step
from longspan.training.state import GlobalState
from longspan.training.train import train
from longspan.training.observability.progress_log import STARTING_JOB, append_to_progress_log
from longspan.training.observability.run_summary import nothing_to_train, print_nothing_to_train, print_run_summary
from longspan.training.resilience.hooks import stop_straggler_detection
from longspan.training.resilience.inprocess import in_supervised_worker
from longspan.training.utils.train_utils import prepare_forward_step_func
from longspan.training.checkpointing.convert import convert_loaded_checkpoint

logger = get_logger(__name__)


def pretrain(
    config: ConfigContainer,
    forward_step_func: Optional[Callable] = None,
    callbacks: Union[list[Callback], CallbackManager, None] = None,
) -> GlobalState:
    """Validate ``config``, set up, train, evaluate on the test split, and return the final GlobalState.

    ``forward_step_func`` defaults to the GPT forward step (the T5 one for a T5ModelProvider). ``callbacks``:
    Callback instances or a CallbackManager (``longspan.training.callbacks``). Megatron Bridge returns None;
    returning the state (train_state, the last losses) is a longspan convenience for scripts and tests.
    """
    if forward_step_func is None:
        t5 = isinstance(config.model, T5ModelProvider)
        forward_step_func = t5_forward_step if t5 else default_forward_step
    return run_training(config, forward_step_func, callbacks)


def run_training(
    config: ConfigContainer,
    forward_step_func: Callable,
    callbacks: Union[list[Callback], CallbackManager, None] = None,
    after_setup: Optional[Callable[[Any, Callable], Callable]] = None,
) -> GlobalState:
    """``pretrain``'s run: setup, then ``after_setup(setup_output, forward_step_func)`` (when given) returns the
    forward step to train with (distillation builds its teacher there, once the process groups exist)."""
    _check_inprocess_restart(config)
    out = setup(config, callbacks=normalize_callbacks(callbacks))  # a bad callback fails before any work
    state = out.state
    try:
        if after_setup is not None:
            forward_step_func = after_setup(out, forward_step_func)
        if config.checkpoint.ckpt_convert_format is not None:  # a conversion run: save what was loaded, stop
            convert_loaded_checkpoint(state, out.model, out.optimizer, out.scheduler, out.checkpointing_context)
            _release(state)
            return state
        # model.attention_backend holds for the whole run: forward, backward, recomputation and evaluation
        with attention_backend_context(config.model.attention_backend, state.device):
            return _train_and_test(out, forward_step_func)
    except BaseException:
        _abandon(state)  # an in-process restart runs again in this process: leave no handlers or open sinks
        raise


def _check_inprocess_restart(config: ConfigContainer) -> None:
    ipr = config.inprocess_restart
    if ipr is not None and ipr.enabled:
        if not in_supervised_worker():
            raise NotSupportedError(
                "inprocess_restart.enabled=True needs longspan's in-process supervisor: start the run with "
                "`longspan pretrain [--nproc-per-node N]` (pretrain() alone does not restart ranks)"
            )


def _abandon(state: GlobalState) -> None:
    """Release what a failed attempt holds: the exit-signal handler and the logger sinks."""
    try:
        _release(state)
    except Exception:  # noqa: BLE001 - best effort while another error propagates
        logger.debug("closing the loggers of a failed run failed", exc_info=True)


def _release(state: GlobalState) -> None:
    """Give back the exit-signal handler and the straggler detector's port, close the logger sinks."""
    stop_straggler_detection(state)
    if state.signal_handler is not None:
        state.signal_handler.release()
        state.signal_handler = None
    state.close_loggers()


def _train_and_test(out: Any, forward_step_func: Callable) -> GlobalState:
    state = out.state
    cfg = state.cfg
    if nothing_to_train(state):  # say so and leave everything as it was: no checkpoint, no logs, no evaluation
        print_nothing_to_train(state)
        _release(state)
        return state
    if cfg.logger.log_progress:
        append_to_progress_log(cfg.checkpoint.save, STARTING_JOB)

    if not cfg.train.skip_train and state.train_state.do_train and cfg.train.train_iters > 0:
        train(
            forward_step_func, out.model, out.optimizer, out.scheduler, out.train_data_iterator,
            out.valid_data_iterator, state, out.checkpointing_context,
        )
    elif cfg.train.skip_train and state.train_state.do_valid and out.valid_data_iterator is not None:
        evaluate_and_print_results(
            state, f"iteration {state.train_state.step}", prepare_forward_step_func(forward_step_func, state),
            out.valid_data_iterator, out.model, cfg, write_to_tensorboard=False,
        )

    exited_early = getattr(state, "exit_code", None) is not None or state.train_state.step < cfg.train.train_iters
    if not exited_early and state.train_state.do_test and out.test_data_iterator is not None:
        state.test_results = evaluate_and_print_results(
            state, f"iteration {state.train_state.step} on test set",
            prepare_forward_step_func(forward_step_func, state), out.test_data_iterator, out.model, cfg,
            write_to_tensorboard=True, sample_generations=False, is_test=True,
        )
    print_run_summary(state)
    stop_straggler_detection(state)
    state.close_loggers()
    return state
