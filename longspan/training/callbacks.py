"""Training callbacks with Megatron Bridge's names (``megatron.bridge.training.callbacks``).

User code hooks into the loop without changing it, in two forms that mix freely and fire in registration order:

- subclass ``Callback`` and override the events it handles: ``pretrain(cfg, fwd, callbacks=[MyCallback()])``;
- register plain functions on a ``CallbackManager``: ``manager.register("on_train_step_end", fn)`` (or
  ``manager.add("on_train_step_end", fn)``), then ``pretrain(cfg, fwd, callbacks=manager)``.

Every callback receives a ``CallbackContext``: the run's ``GlobalState``, the model chunks, a ``user_state`` dict
that persists for the whole run, and the event's own fields. Beyond Bridge, ``context.request_stop()`` ends the run
after the current iteration with a checkpoint, as ``train.exit_interval`` does. An exception inside a callback
becomes a ``CallbackError`` naming the callback and the event (one line, exit 2 from the CLI); checkpoints are
written to a ``.partial`` directory and renamed into place, so the run leaves nothing half-written.

Callbacks fire on every rank with no synchronisation, except the stop request, which is agreed by all ranks (one
flag all-reduce per iteration, only while callbacks are registered). With no callbacks nothing is built or called.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from longspan.core.errors import ConfigError, LongspanError

VALID_EVENTS: frozenset[str] = frozenset({
    "on_data_init_start",
    "on_train_start",
    "on_train_step_start",
    "on_train_step_end",
    "on_train_end",
    "on_eval_start",
    "on_eval_step_start",
    "on_eval_step_end",
    "on_eval_end",
    "on_test_start",
    "on_test_step_start",
    "on_test_step_end",
    "on_test_end",
    "on_checkpoint_save",
})


class CallbackError(LongspanError):
    """A user callback raised: the message names the callback, the event and the original error (its cause)."""


@dataclass
class CallbackContext:
    """What a callback receives. Changing the framework's objects through it is at the user's own risk.

    Field availability by event (others are None): ``state``, ``model``, ``user_state`` always; ``optimizer``,
    ``scheduler`` in the training events, ``on_data_init_start`` and ``on_checkpoint_save``; ``loss_dict``,
    ``grad_norm``, ``skipped_iter`` in ``on_train_step_end``; ``total_loss_dict`` in ``on_eval_end`` and
    ``on_test_end``.
    """

    state: Any
    """The run's GlobalState: ``state.cfg``, ``state.train_state`` (step, consumed samples), timers, sinks."""
    model: list[torch.nn.Module]
    """The model chunks (one per pipeline stage this rank holds)."""
    user_state: dict = field(default_factory=dict)
    """The manager's dict, the same object at every event of the run: data shared between callbacks."""
    optimizer: Optional[Any] = None
    """The optimizer (training events, on_data_init_start, on_checkpoint_save)."""
    scheduler: Optional[Any] = None
    """The learning-rate/weight-decay scheduler (training events, on_data_init_start)."""
    loss_dict: Optional[dict[str, torch.Tensor]] = None
    """The iteration's reduced losses (on_train_step_end)."""
    grad_norm: Optional[float] = None
    """The iteration's gradient norm when computed (on_train_step_end)."""
    skipped_iter: Optional[bool] = None
    """Whether the optimizer skipped the update (fp16 overflow; on_train_step_end)."""
    total_loss_dict: Optional[dict[str, torch.Tensor]] = None
    """The evaluation's losses, Σ/Σ over its steps (on_eval_end, on_test_end)."""
    manager: Optional["CallbackManager"] = field(default=None, repr=False, compare=False)
    """The manager firing the event (what ``request_stop`` reaches)."""

    @property
    def config(self) -> Any:
        """The run's ConfigContainer (``state.cfg``)."""
        return self.state.cfg

    def request_stop(self) -> None:
        """End the run after the current iteration, saving a checkpoint as ``train.exit_interval`` does."""
        if self.manager is None:
            raise RuntimeError("request_stop() needs the CallbackContext of a running pretrain()/finetune()")
        self.manager.request_stop()


CallbackFn = Callable[[CallbackContext], None]


class Callback:
    """Base class: subclass it and override the events to handle; every method is a no-op here."""

    def on_data_init_start(self, context: CallbackContext) -> None:
        """Model, optimizer and checkpoint are ready; the datasets are not opened yet."""

    def on_train_start(self, context: CallbackContext) -> None:
        """The model is in training mode; the first iteration follows."""

    def on_train_step_start(self, context: CallbackContext) -> None:
        """Before each training iteration."""

    def on_train_step_end(self, context: CallbackContext) -> None:
        """After each iteration's optimizer step, before the step counter advances (``train_state.step`` is the
        count of iterations before this one, as in Bridge)."""

    def on_train_end(self, context: CallbackContext) -> None:
        """After the training loop and its final checkpoint, before the test evaluation."""

    def on_eval_start(self, context: CallbackContext) -> None:
        """The model is in evaluation mode; the validation steps follow."""

    def on_eval_step_start(self, context: CallbackContext) -> None:
        """Before each validation step."""

    def on_eval_step_end(self, context: CallbackContext) -> None:
        """After each validation step."""

    def on_eval_end(self, context: CallbackContext) -> None:
        """After the validation steps, before the model goes back to training mode."""

    def on_test_start(self, context: CallbackContext) -> None:
        """The model is in evaluation mode; the test steps follow."""

    def on_test_step_start(self, context: CallbackContext) -> None:
        """Before each test step."""

    def on_test_step_end(self, context: CallbackContext) -> None:
        """After each test step."""

    def on_test_end(self, context: CallbackContext) -> None:
        """After the test steps."""

    def on_checkpoint_save(self, context: CallbackContext) -> None:
        """A checkpoint is complete on disk (renamed into place, tracker written)."""


class CallbackManager:
    """Holds the callbacks of each event, the run's ``user_state``, and a callback's stop request."""

    def __init__(self) -> None:
        self._callbacks: dict[str, list[CallbackFn]] = {event: [] for event in VALID_EVENTS}
        self._user_state: dict = {}
        self._stop_requested = False

    @property
    def user_state(self) -> dict:
        """The dict every CallbackContext of the run carries."""
        return self._user_state

    @property
    def events(self) -> frozenset[str]:
        """The valid event names."""
        return VALID_EVENTS

    def add(self, callback: Union["Callback", list["Callback"], str], fn: Optional[CallbackFn] = None) -> None:
        """Register Callback instances (each overridden event method), or ``add(event_name, fn)`` as ``register``."""
        if isinstance(callback, str):
            if fn is None:
                raise ConfigError(f"CallbackManager.add({callback!r}) needs the function to call: add(event_name, fn)")
            self.register(callback, fn)
            return
        for cb in callback if isinstance(callback, list) else [callback]:
            if not isinstance(cb, Callback):
                raise ConfigError(
                    f"callbacks: {cb!r} is not a Callback; pass Callback instances, or register a function with "
                    "CallbackManager.register(event_name, fn)")
            for event in sorted(VALID_EVENTS):
                method = getattr(type(cb), event)
                if method is not getattr(Callback, event):  # only the events this class overrides cost anything
                    self._callbacks[event].append(getattr(cb, event))

    def register(self, event_name: str, fn: CallbackFn) -> None:
        """Call ``fn(context)`` at every ``event_name``."""
        _check_event(event_name)
        if not callable(fn):
            raise ConfigError(f"callbacks: {fn!r} registered for {event_name} is not callable")
        self._callbacks[event_name].append(fn)

    def list_callbacks(self, event_name: str) -> list[CallbackFn]:
        """The callables of ``event_name`` in firing order."""
        _check_event(event_name)
        return list(self._callbacks[event_name])

    def has_callbacks(self, event_name: str) -> bool:
        """Whether anything fires at ``event_name``."""
        return bool(self._callbacks.get(event_name))

    def fire(self, event_name: str, context: CallbackContext) -> None:
        """Call each callback of ``event_name``; one that raises ends the run with a ``CallbackError``."""
        _check_event(event_name)
        for fn in self._callbacks[event_name]:
            try:
                fn(context)
            except Exception as exc:
                lines = str(exc).strip().splitlines()
                detail = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
                raise CallbackError(f"callback {callback_name(fn)} failed in {event_name}: {detail}") from exc

    def request_stop(self) -> None:
        """Ask the loop to end after the current iteration, with a checkpoint."""
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        """Whether a callback asked for the run to end."""
        return self._stop_requested


def callback_name(fn: Callable) -> str:
    """``Class.on_event`` for a Callback's method, the function's qualified name otherwise."""
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        return f"{type(owner).__name__}.{fn.__name__}"
    return getattr(fn, "__qualname__", None) or repr(fn)


def _check_event(event_name: str) -> None:
    if event_name not in VALID_EVENTS:
        raise ConfigError(f"callbacks: unknown event {event_name!r}; valid events: {', '.join(sorted(VALID_EVENTS))}")


def normalize_callbacks(callbacks: Union[list[Callback], Callback, CallbackManager, None]) -> Optional[CallbackManager]:
    """``pretrain``'s ``callbacks`` argument as a manager: a manager as is, Callback instances in a new one."""
    if callbacks is None or isinstance(callbacks, CallbackManager):
        return callbacks
    manager = CallbackManager()
    manager.add(callbacks if isinstance(callbacks, list) else [callbacks])
    return manager


def callbacks_from_specs(specs: list[str]) -> Optional[CallbackManager]:
    """The CLI's ``--callbacks MODULE:NAME`` (repeatable) as one manager: NAME is a Callback subclass (built with no
    arguments), a Callback instance, a list of them, or a CallbackManager (its callbacks and user_state join)."""
    if not specs:
        return None
    manager = CallbackManager()
    for spec in specs:
        obj = _import_spec(spec)
        if isinstance(obj, type) and issubclass(obj, Callback):
            obj = obj()
        if isinstance(obj, CallbackManager):
            for event, fns in obj._callbacks.items():
                manager._callbacks[event].extend(fns)
            manager.user_state.update(obj.user_state)
        elif isinstance(obj, Callback) or (isinstance(obj, list) and all(isinstance(o, Callback) for o in obj)):
            manager.add(obj)
        else:
            raise ConfigError(f"--callbacks {spec}: {type(obj).__name__} is not a Callback subclass or instance, a "
                              "list of Callback instances, or a CallbackManager")
    return manager


def _import_spec(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--callbacks {spec}: give MODULE:NAME (a Callback subclass or instance, a list of them, "
                          "or a CallbackManager)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):  # the module itself, not one it imports
            raise ConfigError(f"--callbacks {spec}: cannot import module {module_name!r}") from exc
        raise
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"--callbacks {spec}: module {module_name!r} has no {attr!r}") from None


def should_fire(callback_manager: Optional[CallbackManager], event_name: str) -> bool:
    """Whether ``callback_manager`` exists and has something registered for ``event_name``."""
    return callback_manager is not None and callback_manager.has_callbacks(event_name)


def attach_callbacks(state: Any, callbacks: Union[list[Callback], Callback, CallbackManager, None]) -> None:
    """Give the run its manager (``state.callback_manager``); a manager reused for another run starts unstopped."""
    manager = normalize_callbacks(callbacks)
    if manager is not None:
        manager._stop_requested = False
    state.callback_manager = manager


def fire_event(state: Any, event_name: str, model: list[torch.nn.Module], **fields: Any) -> None:
    """Fire ``event_name`` with a context of ``state``, ``model`` and ``fields``; nothing at all without callbacks."""
    manager = getattr(state, "callback_manager", None)
    if not should_fire(manager, event_name):
        return
    manager.fire(event_name, CallbackContext(state=state, model=model, user_state=manager.user_state,
                                             manager=manager, **fields))


def stop_requested(state: Any) -> bool:
    """Whether a callback on any rank asked to stop (every rank calls this at the same point of each iteration)."""
    manager = getattr(state, "callback_manager", None)
    if manager is None:
        return False
    stop = manager.stop_requested
    if dist.is_initialized() and dist.get_world_size() > 1:  # one rank's request stops them all, at one iteration
        flag = torch.tensor([int(stop)], dtype=torch.int32, device=state.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
    return stop
