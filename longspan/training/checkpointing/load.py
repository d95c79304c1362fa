"""Loading ``torch_dist`` checkpoints (the layout ``save.py`` writes): which checkpoint to resume or
finetune from, restoring model, optimizer, scheduler, rerun and training progress (RNG is returned, not
applied), PEFT's base-then-adapters load, and ``use_checkpoint_args`` (architecture and tokenizer from a
checkpoint's run_config.yaml).

Model and optimizer state reshard on load: DTensor-sharded state is read by global name and shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from longspan.config.explicit import explicit_fields, is_recipe_source
from longspan.config.schema.training import CheckpointConfig
from longspan.conversion import is_hf_model_dir
from longspan.core.errors import CheckpointError
from longspan.core.logging import get_logger, print_rank_0
from longspan.core.model_parallel_config import PARALLEL_CONFIG_FIELDS
from longspan.peft.adapters import init_dora_magnitudes, is_adapter_key, is_finetuned_state_key
from longspan.training.checkpointing.io import (
    TRAIN_STATE_FILENAME,
    check_shapes,
    iteration_from_dir,
    load_shards,
    load_weights_only,
    read_metadata,
    reading,
    single_process_quiet,
)
from longspan.training.checkpointing.save import (
    OPTIM_SD_OPTIONS,
    RUN_CONFIG_FILENAME,
    TOKENIZER_DIRNAME,
    TRACKER_FILENAME,
    checkpoint_module,
    current_rank,
    current_world_size,
    get_checkpoint_dir,
    get_rng_state,
    optimizer_extra_state,
    optimizer_module,
    read_tracker,
    rerun_state,
    rng_key_for,
    unwrap_optimizer,
)
from longspan.training.checkpointing.hf_weights import load_hf_pretrained
from longspan.training.checkpointing.strictness import apply_strictness
from longspan.training.checkpointing.model_fields import merge_pretrained_model_fields

logger = get_logger(__name__)


@dataclass
class LoadedCheckpoint:
    """What ``load_checkpoint`` found: the directory, the iteration the run goes on from, and RNG state still to
    be applied; ``finetune`` when only its weights were taken (a pretrained checkpoint or HF model: the run starts
    at 0, and ``saved_iteration`` is the iteration the checkpoint was saved at)."""

    directory: Path
    iteration: int
    rng_state: dict[str, Any] | None = None
    finetune: bool = False
    saved_iteration: int | None = None
    # checkpoint.dist_ckpt_strictness: model tensors the checkpoint lacks, checkpoint tensors the model lacks
    unexpected_keys: list[str] = dataclasses.field(default_factory=list)
    missing_keys: list[str] = dataclasses.field(default_factory=list)


def find_checkpoint(ckpt_cfg: Any) -> tuple[Path, int, bool] | None:
    """(directory, iteration, is_finetune) of the checkpoint to load, or None to start from scratch.

    ``checkpoint.load`` wins when it holds a checkpoint; otherwise ``pretrained_checkpoint`` loads weights
    only (finetuning). ``ckpt_step`` picks an iteration other than the tracker's.
    """
    for root, pretrained in ((ckpt_cfg.load, False), (ckpt_cfg.pretrained_checkpoint, True)):
        if not root:
            continue
        root_path = Path(root)
        if pretrained and is_hf_model_dir(root_path):
            return root_path, 0, True  # Hugging Face weights: load_checkpoint reads them through AutoBridge
        if ckpt_cfg.ckpt_step is not None and not pretrained:
            iteration = ckpt_cfg.ckpt_step
        else:
            iteration = read_tracker(root_path)
        if iteration is None:
            if (root_path / ".metadata").is_file():  # pointed straight at an iter_ directory
                return root_path, iteration_from_dir(root_path), pretrained or ckpt_cfg.finetune
            if ckpt_cfg.exit_on_missing_checkpoint or pretrained:
                field_name = "checkpoint.pretrained_checkpoint" if pretrained else "checkpoint.load"
                raise CheckpointError(
                    f"{field_name}={root}: no checkpoint there ({TRACKER_FILENAME} not found)"
                    + ("" if pretrained else "; unset checkpoint.exit_on_missing_checkpoint to start from scratch")
                )
            continue
        directory = get_checkpoint_dir(root_path, iteration)
        if not (directory / ".metadata").is_file():
            raise CheckpointError(f"checkpoint {directory} is missing or incomplete (no .metadata file)")
        return directory, iteration, pretrained or ckpt_cfg.finetune
    return None


def _stored_keys(directory: Path) -> set[str]:
    return set(read_metadata(directory).state_dict_metadata)


def load_checkpoint(
    state: Any,
    model: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    strict: bool = True,
    checkpointing_context: dict[str, Any] | None = None,
    skip_load_to_model_and_opt: bool = False,
    *,
    checkpoint_config: Any = None,
    model_keys: Callable[[str], bool] | None = None,
) -> LoadedCheckpoint | None:
    """Load the checkpoint ``checkpoint.load`` (or ``pretrained_checkpoint``) names into model and state.

    Restores model, optimizer (``load_optim``), scheduler and train state; returns the RNG state (when
    ``load_rng``) without applying it, because RNG must be restored after everything that draws from it at
    start-up (building data iterators does). Returns None when there is nothing to load.
    ``checkpoint_config`` replaces ``cfg.checkpoint``; ``model_keys`` limits the model tensors loaded (PEFT).
    """
    cfg = state.cfg
    ckpt_cfg = checkpoint_config if checkpoint_config is not None else cfg.checkpoint
    found = find_checkpoint(ckpt_cfg)
    if found is None:
        return None
    directory, iteration, finetune = found
    if is_hf_model_dir(directory):
        load_hf_pretrained(directory, model, select=model_keys)
        return LoadedCheckpoint(directory, 0, None, finetune=True)
    module = checkpoint_module(model)
    stored = _stored_keys(directory)

    model_sd = get_model_state_dict(module)
    if model_keys is not None:
        model_sd = {k: v for k, v in model_sd.items() if model_keys(k)}
        strict = False  # the other tensors come from another checkpoint
    load_optim = ckpt_cfg.load_optim and not finetune and optimizer is not None
    model_sd, unexpected, missing = _model_tensors_to_load(ckpt_cfg, model_sd, stored, directory, load_optim)
    strict = strict and not unexpected  # tensors the checkpoint lacks keep their values
    check_shapes(directory, model_sd, "model")
    load_rng = ckpt_cfg.load_rng and not finetune
    to_load: dict[str, Any] = {"model": model_sd}
    torch_optimizer = unwrap_optimizer(optimizer) if load_optim else None
    main_module = optimizer_module(module, optimizer) if load_optim else module
    if load_optim:
        to_load.update(_optimizer_sections(optimizer, torch_optimizer, module, main_module, stored, directory))
    main_params_only = _main_params_without_optimizer(ckpt_cfg, optimizer, module, stored, directory, load_optim,
                                                      finetune)
    if main_params_only is not None:
        to_load["main_params"] = {k: v for k, v in main_params_only.state_dict().items() if k not in set(unexpected)}
    if not finetune and opt_param_scheduler is not None and any(k.startswith("scheduler") for k in stored):
        to_load["scheduler"] = opt_param_scheduler.state_dict()
    rng_key, has_rng = _add_rng_template(to_load, stored, load_rng)
    if not finetune and "rerun_state_machine" in {k.split(".")[0] for k in stored}:
        rerun = rerun_state(state)
        if rerun:
            to_load.update(rerun)

    if not skip_load_to_model_and_opt:
        with single_process_quiet():
            load_shards(to_load, directory, no_dist=not dist.is_initialized())
        set_model_state_dict(module, to_load["model"], options=StateDictOptions(strict=strict))
        if load_optim:
            _restore_optimizer(to_load, optimizer, torch_optimizer, module, main_module)
        else:
            _restore_main_params_only(to_load, optimizer, main_params_only)
    if "scheduler" in to_load:
        _restore_scheduler(opt_param_scheduler, to_load["scheduler"], iteration, directory, ckpt_cfg)
    if "rerun_state_machine" in to_load:
        state.rerun_state_machine.load_state_dict(to_load["rerun_state_machine"])

    saved_iteration = iteration
    if finetune:
        print_rank_0(f"loaded weights from {directory} for finetuning; starting at iteration 0", logger)
        iteration = 0
    else:
        _restore_train_state(state, directory)
        print_rank_0(f"loaded checkpoint {directory} at iteration {iteration}", logger)
    return LoadedCheckpoint(directory, iteration, to_load["rng"][rng_key] if has_rng else None, finetune=finetune,
                            saved_iteration=saved_iteration, unexpected_keys=unexpected, missing_keys=missing)


def _add_rng_template(to_load: dict[str, Any], stored: set[str], load_rng: bool) -> tuple[str, bool]:
    """This rank's RNG-state key, and whether its state is loaded (a template added to ``to_load``)."""
    rng_key = rng_key_for(current_rank(), current_world_size())
    has_rng = load_rng and any(k.startswith(f"rng.{rng_key}") for k in stored)
    if has_rng:
        to_load["rng"] = {rng_key: get_rng_state()}
    elif load_rng:
        print_rank_0(
            "checkpoint holds no RNG state for this world size; generators start from the seed instead", logger
        )
    return rng_key, has_rng


def _optimizer_sections(optimizer: Any, torch_optimizer: torch.optim.Optimizer | None, module: torch.nn.Module,
                        main_module: torch.nn.Module, stored: set[str], directory: Path) -> dict[str, Any]:
    """The optimizer's templates for ``dcp.load``: its state, the main params and extra state the checkpoint has."""
    if not any(k.startswith("optimizer.") for k in stored):
        raise CheckpointError(
            f"checkpoint {directory} holds no optimizer state (saved with save_optim=false); "
            "set checkpoint.load_optim=false to load the weights only"
        )
    sections: dict[str, Any] = {
        "optimizer": get_optimizer_state_dict(main_module, torch_optimizer, options=OPTIM_SD_OPTIONS)}
    if main_module is not module and any(k.startswith("main_params.") for k in stored):
        sections["main_params"] = main_module.state_dict()
    if any(k.startswith("optimizer_extra") for k in stored):
        sections["optimizer_extra"] = optimizer_extra_state(optimizer)
    return sections


def _model_tensors_to_load(ckpt_cfg: Any, model_sd: dict[str, Any], stored: set[str], directory: Path,
                           load_optim: bool) -> tuple[dict[str, Any], list[str], list[str]]:
    """The model tensors to read under ``checkpoint.dist_ckpt_strictness``, and its (unexpected, missing) keys;
    a tensor the checkpoint lacks has no optimizer state there either."""
    model_sd, unexpected, missing = apply_strictness(ckpt_cfg.dist_ckpt_strictness, model_sd, stored, directory)
    if unexpected and load_optim:
        raise CheckpointError(
            f"checkpoint {directory} lacks the model tensors {', '.join(unexpected[:3])}, so it lacks their "
            f"optimizer state too (checkpoint.dist_ckpt_strictness={ckpt_cfg.dist_ckpt_strictness!r}): set "
            "checkpoint.load_optim=false to load the weights it has"
        )
    return model_sd, unexpected, missing


def _main_params_without_optimizer(ckpt_cfg: CheckpointConfig, optimizer: Any, module: torch.nn.Module,
                                   stored: set[str], directory: Path, load_optim: bool,
                                   finetune: bool) -> torch.nn.Module | None:
    """With ``load_main_params_from_ckpt`` (and no optimizer state loaded): the module of fp32 main params to
    fill from the checkpoint's saved main params, or None when the run keeps none (full-precision params)."""
    if load_optim or finetune or optimizer is None or not ckpt_cfg.load_main_params_from_ckpt:
        return None
    main_module = optimizer_module(module, optimizer)
    if main_module is module:
        return None
    if not any(k.startswith("main_params.") for k in stored):
        raise CheckpointError(
            f"checkpoint.load_main_params_from_ckpt=True but checkpoint {directory} holds no fp32 main params (saved "
            "with full-precision params or save_optim=false); set checkpoint.load_main_params_from_ckpt=false"
        )
    return main_module


def _restore_main_params_only(to_load: dict[str, Any], optimizer: Any, main_module: torch.nn.Module | None) -> None:
    """Without the optimizer state: the fp32 main params from the checkpoint (``load_main_params_from_ckpt``)
    or, by default, rebuilt from the loaded low-precision weights."""
    if main_module is not None:
        main_module.load_state_dict(to_load["main_params"], strict=False)  # tensors the checkpoint lacks stay
        optimizer.copy_main_params_to_model_params()
    elif getattr(optimizer, "float16_groups", None) and any(optimizer.float16_groups):
        optimizer.reload_model_params()


def _restore_optimizer(to_load: dict[str, Any], optimizer: Any, torch_optimizer: torch.optim.Optimizer | None,
                       module: torch.nn.Module, main_module: torch.nn.Module) -> None:
    """Put the loaded optimizer sections back; main params (when saved) are copied to the model params."""
    set_optimizer_state_dict(
        main_module, torch_optimizer, to_load["optimizer"], options=OPTIM_SD_OPTIONS
    )
    _load_optimizer_extra_state(optimizer, to_load.get("optimizer_extra", {}))
    if main_module is not module:
        if "main_params" in to_load:
            main_module.load_state_dict(to_load["main_params"])
            optimizer.copy_main_params_to_model_params()
        else:
            optimizer.reload_model_params()


def _load_optimizer_extra_state(optimizer: Any, extra: dict[str, Any]) -> None:
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is not None and "grad_scaler" in extra:
        scaler.load_state_dict(extra["grad_scaler"])


def _restore_scheduler(opt_param_scheduler: Any, scheduler_state: dict[str, Any], iteration: int, directory: Path,
                       ckpt_cfg: Any) -> None:
    try:
        opt_param_scheduler.load_state_dict(scheduler_state)
    except CheckpointError as exc:
        # Say the real situation first: this run resumes an earlier run's checkpoint.
        raise CheckpointError(
            f"resuming the checkpoint at iteration {iteration} in {directory} (checkpoint.load="
            f"{ckpt_cfg.load}), whose learning-rate schedule differs from this config: {exc}; to start fresh "
            "instead, set checkpoint.load=null or use another checkpoint.save directory"
        ) from exc


def _restore_train_state(state: Any, directory: Path) -> None:
    train_state_file = directory / TRAIN_STATE_FILENAME
    train_state_dict = load_weights_only(train_state_file, "training progress")
    with reading(train_state_file, "training progress"):
        if not isinstance(train_state_dict, dict) or "step" not in train_state_dict:
            raise ValueError(f"it holds {type(train_state_dict).__name__} without a 'step' entry")
        state.train_state.load_state_dict(train_state_dict)


def load_peft_checkpoint(
    state: Any,
    model: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    checkpointing_context: dict[str, Any] | None = None,
) -> LoadedCheckpoint | None:
    """PEFT: the frozen base from ``pretrained_checkpoint`` (weights only), then, when ``checkpoint.load`` holds
    a checkpoint of this run, what the finetune changed (adapters, routing bias), optimizer, scheduler, RNG and
    progress. Starting fresh, DoRA's magnitudes are set from the loaded base."""
    ckpt_cfg = state.cfg.checkpoint
    if not ckpt_cfg.pretrained_checkpoint:
        raise CheckpointError(
            "peft is set but checkpoint.pretrained_checkpoint is not: adapters train on a pretrained base; set it "
            "to a longspan checkpoint (or Hugging Face model directory)"
        )
    base_cfg = dataclasses.replace(ckpt_cfg, load=None)
    load_checkpoint(state, model, None, None, checkpointing_context=checkpointing_context,
                    checkpoint_config=base_cfg, model_keys=lambda k: not is_adapter_key(k))
    resume_cfg = dataclasses.replace(ckpt_cfg, pretrained_checkpoint=None)
    if resume_cfg.load and find_checkpoint(resume_cfg) is not None:
        return load_checkpoint(state, model, optimizer, opt_param_scheduler,
                               checkpointing_context=checkpointing_context, checkpoint_config=resume_cfg,
                               model_keys=is_finetuned_state_key)
    init_dora_magnitudes(model)
    return None


def use_saved_tokenizer(tokenizer_cfg: Any, saved: Path) -> None:
    """Point ``tokenizer_cfg`` at the tokenizer files saved in a checkpoint (``Tokenizer.save_files``)."""
    ttype = tokenizer_cfg.tokenizer_type
    if ttype == "HuggingFaceTokenizer":
        tokenizer_cfg.tokenizer_model = str(saved)
    elif ttype == "SentencePieceTokenizer" and (saved / "tokenizer.model").is_file():
        tokenizer_cfg.tokenizer_model = str(saved / "tokenizer.model")
    elif ttype == "GPT2BPETokenizer" and (saved / "vocab.json").is_file():
        tokenizer_cfg.vocab_file = str(saved / "vocab.json")
        tokenizer_cfg.merge_file = str(saved / "merges.txt")
    elif ttype == "TikTokenizer" and (saved / "tiktoken_vocab.json").is_file():
        tokenizer_cfg.tokenizer_model = str(saved / "tiktoken_vocab.json")
    # NullTokenizer and ByteLevelTokenizer are described by the config alone.


def _adopt_saved_tokenizer(cfg: Any, saved_cfg: Any, directory: Path) -> None:
    """A run that names no tokenizer (the finetuning recipes) takes the checkpoint's, from its saved files; the
    tokenizer fields the user set on purpose (a YAML key or an override, e.g. ``tokenizer.chat_template``) keep
    the user's values."""
    if cfg.tokenizer.tokenizer_type is not None:
        return
    kept = {name: getattr(cfg.tokenizer, name) for name, source in explicit_fields(cfg, "tokenizer").items()
            if not is_recipe_source(source) and hasattr(cfg.tokenizer, name)}
    cfg.tokenizer = saved_cfg.tokenizer
    saved_files = directory / TOKENIZER_DIRNAME
    if saved_files.is_dir():
        use_saved_tokenizer(cfg.tokenizer, saved_files)
    for name, value in kept.items():
        setattr(cfg.tokenizer, name, value)
    note = f"; kept as set: {', '.join(sorted(kept))}" if kept else ""
    print_rank_0(f"use_checkpoint_args: tokenizer {cfg.tokenizer.tokenizer_type} from {directory}{note}", logger)


def apply_checkpoint_args(cfg: Any) -> list[str]:
    """``checkpoint.use_checkpoint_args``: take the model architecture from the checkpoint's run_config.yaml.

    Every model field except the parallel layout (ModelParallelConfig's fields) comes from the saved config,
    so a run resumes with the saved architecture whatever the recipe says, except values set on purpose that the
    weights do not contradict (``merge_pretrained_model_fields``). Returns the names of the fields that changed.
    """
    found = find_checkpoint(cfg.checkpoint)
    if found is None or is_hf_model_dir(found[0]):  # an HF directory's config.json is applied at setup
        return []
    run_config = found[0] / RUN_CONFIG_FILENAME
    if not run_config.is_file():
        raise CheckpointError(f"checkpoint.use_checkpoint_args=true but {run_config} does not exist")
    saved_cfg = type(cfg).from_yaml(str(run_config))
    _adopt_saved_tokenizer(cfg, saved_cfg, found[0])
    saved = saved_cfg.model
    if type(saved) is not type(cfg.model):
        raise CheckpointError(
            f"checkpoint {found[0]} holds a {type(saved).__name__}, but this run builds a {type(cfg.model).__name__}"
        )
    merge = merge_pretrained_model_fields(cfg, saved, RUN_CONFIG_FILENAME, str(found[0]), PARALLEL_CONFIG_FIELDS)
    if merge.changed or merge.kept:
        print_rank_0(f"use_checkpoint_args: {merge.describe(str(run_config))}", logger)
    return merge.changed
