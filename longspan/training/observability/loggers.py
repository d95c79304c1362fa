"""Metric sinks: TensorBoard, a JSON-lines file, and the optional W&B / MLflow / Comet clients.

Every sink is created on the last rank only (Megatron logs there: under pipeline parallelism it holds the
loss). Optional integrations are extras (``pip install longspan[wandb]`` ...): configuring one whose
client library is missing is a user error and raises ``ConfigError`` with one line saying how to install
it. ``check_logger_dependencies`` performs that check without creating anything, so ``pretrain`` can fail
fast at start-up instead of at the first log line.

Logger config fields read here (``cfg.logger``): ``tensorboard_dir``, ``tensorboard_queue_size``,
``wandb_project``, ``wandb_exp_name``, ``wandb_save_dir``, ``wandb_entity`` (Bridge's spec), and
``mlflow_experiment``, ``mlflow_run_name``, ``mlflow_tracking_uri``, ``mlflow_tags``, ``comet_project``,
``comet_experiment_name``, ``comet_workspace``, ``comet_api_key``, ``comet_tags``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import time
import uuid
from typing import Any, Mapping, Optional

import torch

from longspan.config.rules.run_dirs import run_directory
from longspan.config.schema.container import ConfigContainer
from longspan.config.schema.training import LoggerConfig
from longspan.core.errors import ConfigError
from longspan.core.logging import get_logger

logger = get_logger(__name__)

METRICS_FILENAME = "metrics.jsonl"

# (config field that enables it, importable module, pip extra)
_OPTIONAL_INTEGRATIONS = (
    ("wandb_project", "wandb", "wandb"),
    ("mlflow_experiment", "mlflow", "mlflow"),
    ("comet_project", "comet_ml", "comet"),
)


def check_logger_dependencies(logger_cfg: Optional[LoggerConfig]) -> None:
    """Raise ``ConfigError`` when an optional integration is configured but its client is not installed, or
    when MLflow would refuse the tracking store (checked at start-up, before anything is trained or written)."""
    if logger_cfg is None:
        return
    for field_name, module, extra in _OPTIONAL_INTEGRATIONS:
        if getattr(logger_cfg, field_name) and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"logger.{field_name} is set but {module} is not installed: pip install longspan[{extra}]"
            )
    if logger_cfg.mlflow_experiment:
        _check_mlflow_store(logger_cfg)


def _check_mlflow_store(logger_cfg: LoggerConfig) -> None:
    mlflow = _import_optional(logger_cfg, "mlflow_experiment")
    uri = logger_cfg.mlflow_tracking_uri
    utils = getattr(getattr(getattr(mlflow, "tracking", None), "_tracking_service", None), "utils", None)
    get_store = getattr(utils, "_get_store", None)  # private, but the one way to ask without starting a run
    if get_store is None:
        return  # another MLflow: its refusal is still turned into one line when the run starts
    try:
        get_store(uri or None)
    except mlflow.exceptions.MlflowException as exc:
        _raise_if_file_store_refused(mlflow, uri, exc)


def _raise_if_file_store_refused(mlflow: Any, uri: Optional[str], exc: Exception) -> None:
    """MLflow 3 refuses its file store unless the user opts in; the choice stays the user's, so say how."""
    if "MLFLOW_ALLOW_FILE_STORE" not in str(exc):
        return
    where = f"logger.mlflow_tracking_uri={uri}" if uri else f"MLflow's tracking URI {mlflow.get_tracking_uri()}"
    raise ConfigError(
        f"{where} is a file store, which MLflow {getattr(mlflow, '__version__', '')} opens only with "
        f"MLFLOW_ALLOW_FILE_STORE=true in the environment; set it, or use a database, e.g. "
        f"logger.mlflow_tracking_uri=sqlite:///mlflow.db"
    ) from None


def _import_optional(logger_cfg: LoggerConfig, field_name: str) -> Any:
    for name, module, extra in _OPTIONAL_INTEGRATIONS:
        if name == field_name:
            try:
                return __import__(module)
            except ImportError:
                raise ConfigError(
                    f"logger.{field_name} is set but {module} is not installed: pip install longspan[{extra}]"
                ) from None
    raise KeyError(field_name)


# ---------------------------------------------------------------------------------------------- values
def to_python_scalar(value: Any) -> Any:
    """A JSON-friendly scalar: tensors become floats/ints, NaN and Inf become None, others pass through."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return [to_python_scalar(v) for v in value.detach().flatten().tolist()]
        value = value.detach().item()
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): to_python_scalar(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python_scalar(v) for v in value]
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        return str(value)
    return as_float if math.isfinite(as_float) else None


_MLFLOW_BAD_CHARS = re.compile(r"[^0-9A-Za-z_\-. /]")


def sanitize_mlflow_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """MLflow accepts only finite floats and names of ``[A-Za-z0-9_-. /]``; replace the rest with ``_``."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        scalar = to_python_scalar(value)
        if isinstance(scalar, (int, float)) and not isinstance(scalar, bool):
            out[_MLFLOW_BAD_CHARS.sub("_", key)] = float(scalar)
    return out


# ---------------------------------------------------------------------------------------------- run identity
@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """What every sink calls a run: ``name``, its directory's name (the same across resumes), and ``run_id``,
    this launch of it (the name, the start time and a random suffix)."""

    name: str
    run_id: str


def run_identity(cfg: ConfigContainer, start_time: float) -> RunIdentity:
    """The run's name (the directory holding both ``checkpoint.save`` and ``logger.tensorboard_dir``, else that of
    ``checkpoint.save``, else of the TensorBoard directory) and this launch's id."""
    save = _checkpoint_save(cfg)
    tb_dir = cfg.logger.tensorboard_dir if cfg.logger is not None else None
    parents = {os.path.dirname(os.path.abspath(path)) for path in (save, tb_dir) if path}
    if save and tb_dir and len(parents) == 1:  # runs/NAME/checkpoints beside runs/NAME/tensorboard
        name = os.path.basename(parents.pop())
    elif save:
        name = os.path.basename(run_directory(save))
    elif tb_dir:
        name = os.path.basename(os.path.dirname(os.path.normpath(tb_dir)) or os.path.normpath(tb_dir))
    else:
        name = "longspan"
    name = name or "longspan"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(start_time))
    return RunIdentity(name, f"{name}-{stamp}-{uuid.uuid4().hex[:6]}")


# ---------------------------------------------------------------------------------------------- JSON lines
class MetricsJSONLWriter:
    """Appends one JSON object per line to ``path``; the file is opened on the first write.

    Values go through ``to_python_scalar`` so the file is strict JSON (no NaN: non-finite numbers are
    written as null). The file is line-buffered so a crashed run still leaves every finished line.
    """

    def __init__(self, path: str, run: Optional[RunIdentity] = None) -> None:
        self.path = path
        self.run = run
        self._file: Optional[Any] = None

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one line, led by the run's name and id when the writer has them (a resumed run
        appends to the same file: the id tells its launches apart)."""
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")
        line = {"run": self.run.name, "run_id": self.run.run_id, **record} if self.run is not None else dict(record)
        self._file.write(json.dumps(to_python_scalar(line), allow_nan=False) + "\n")

    def log(self, record: Mapping[str, Any]) -> None:
        """Alias of ``write`` (the name other metric clients use)."""
        self.write(record)

    def flush(self) -> None:
        """Flush buffered lines to disk."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Close the file; a later ``write`` reopens it in append mode."""
        if self._file is not None:
            self._file.close()
            self._file = None


def metrics_jsonl_path(cfg: ConfigContainer) -> Optional[str]:
    """Where ``metrics.jsonl`` goes: beside the TensorBoard logs, else in ``checkpoint.save``, else nowhere."""
    tb_dir = cfg.logger.tensorboard_dir if cfg.logger is not None else None
    if tb_dir:
        return os.path.join(tb_dir, METRICS_FILENAME)
    save_dir = _checkpoint_save(cfg)
    if save_dir:
        return os.path.join(save_dir, METRICS_FILENAME)
    return None


# ---------------------------------------------------------------------------------------------- builders
def _checkpoint_save(cfg: ConfigContainer) -> Optional[str]:
    return cfg.checkpoint.save if cfg.checkpoint is not None else None


def build_tensorboard_writer(logger_cfg: Optional[LoggerConfig], run: Optional[RunIdentity] = None,
                             step: int = 0) -> Optional[Any]:
    """A ``SummaryWriter`` on ``logger.tensorboard_dir`` with ``tensorboard_queue_size``; None if unset. With
    ``run``, its name and id go in as the text ``run`` at ``step`` (where this launch starts)."""
    tb_dir = logger_cfg.tensorboard_dir if logger_cfg is not None else None
    if not tb_dir:
        return None
    # start-up time: tensorboard loads only when a run writes to it
    from torch.utils.tensorboard import SummaryWriter

    logger.info(f"> setting tensorboard in {tb_dir}")
    writer = SummaryWriter(log_dir=tb_dir, max_queue=int(logger_cfg.tensorboard_queue_size))
    if run is not None:
        writer.add_text("run", f"{run.name} (run id {run.run_id})", step)
    return writer


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    return str(obj)


def _config_as_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-safe view of the config for experiment trackers (``to_dict`` when the container has it)."""
    raw = cfg.to_dict() if hasattr(cfg, "to_dict") else _json_default(cfg)
    return json.loads(json.dumps(raw, default=_json_default))


def build_wandb_logger(cfg: ConfigContainer, run: Optional[RunIdentity] = None) -> Optional[Any]:
    """Initialize a W&B run from ``logger.wandb_*`` and return the ``wandb`` module; None if unset. Without
    ``logger.wandb_exp_name`` the run is named after ``run`` (the run directory's name)."""
    logger_cfg = cfg.logger
    project = logger_cfg.wandb_project if logger_cfg is not None else None
    if not project:
        return None
    wandb = _import_optional(logger_cfg, "wandb_project")
    exp_name = logger_cfg.wandb_exp_name
    if exp_name == "":
        raise ConfigError("logger.wandb_exp_name is empty; set a run name when logger.wandb_project is set")
    save_dir = logger_cfg.wandb_save_dir
    if not save_dir:
        base = _checkpoint_save(cfg) or os.getcwd()
        save_dir = os.path.join(base, "wandb")
    os.makedirs(save_dir, exist_ok=True)
    config = _config_as_dict(cfg)
    if run is not None:
        exp_name = exp_name or run.name
        config["run_id"] = run.run_id
    wandb.init(
        dir=save_dir,
        name=exp_name,
        project=project,
        entity=logger_cfg.wandb_entity,
        config=config,
    )
    return wandb


def build_mlflow_logger(cfg: ConfigContainer, run: Optional[RunIdentity] = None) -> Optional[Any]:
    """Start an MLflow run from ``logger.mlflow_*`` and return the ``mlflow`` module; None if unset. ``run``'s
    name and id join the tags (``logger.mlflow_tags`` win a clash)."""
    logger_cfg = cfg.logger
    experiment = logger_cfg.mlflow_experiment if logger_cfg is not None else None
    if not experiment:
        return None
    mlflow = _import_optional(logger_cfg, "mlflow_experiment")
    uri = logger_cfg.mlflow_tracking_uri
    if uri:
        mlflow.set_tracking_uri(uri)
    try:
        mlflow.set_experiment(experiment)
    except mlflow.exceptions.MlflowException as exc:
        _raise_if_file_store_refused(mlflow, uri, exc)
        raise
    tags = logger_cfg.mlflow_tags
    if run is not None:
        tags = {"longspan_run": run.name, "longspan_run_id": run.run_id, **(tags or {})}
    mlflow.start_run(run_name=logger_cfg.mlflow_run_name, tags=tags)
    return mlflow


def build_comet_logger(cfg: ConfigContainer, run: Optional[RunIdentity] = None) -> Optional[Any]:
    """Create a Comet experiment from ``logger.comet_*`` and return it; None if unset. ``run``'s name and id are
    logged as the experiment's ``longspan_run`` / ``longspan_run_id`` values."""
    logger_cfg = cfg.logger
    project = logger_cfg.comet_project if logger_cfg is not None else None
    if not project:
        return None
    comet_ml = _import_optional(logger_cfg, "comet_project")
    experiment = comet_ml.start(
        api_key=logger_cfg.comet_api_key,
        workspace=logger_cfg.comet_workspace,
        project=project,
    )
    name = logger_cfg.comet_experiment_name
    if name:
        experiment.set_name(name)
    tags = logger_cfg.comet_tags
    if tags:
        experiment.add_tags(list(tags))
    if run is not None:
        experiment.log_others({"longspan_run": run.name, "longspan_run_id": run.run_id})
    return experiment


# ---------------------------------------------------------------------------------------------- fan-out
def log_scalars(
    metrics: Mapping[str, Any],
    step: int,
    tb_writer: Optional[Any] = None,
    wandb_logger: Optional[Any] = None,
    mlflow_logger: Optional[Any] = None,
    comet_logger: Optional[Any] = None,
) -> None:
    """Write each ``tag -> value`` of ``metrics`` at ``step`` to every sink that is not None."""
    if not metrics:
        return
    if tb_writer is not None:
        for tag, value in metrics.items():
            tb_writer.add_scalar(tag, value, step)
    if wandb_logger is None and mlflow_logger is None and comet_logger is None:
        return
    scalars = {k: to_python_scalar(v) for k, v in metrics.items()}
    if wandb_logger is not None:
        wandb_logger.log(scalars, step)
    if mlflow_logger is not None:
        mlflow_logger.log_metrics(sanitize_mlflow_metrics(scalars), step=step)
    if comet_logger is not None:
        comet_logger.log_metrics(scalars, step=step)
