"""``AutoBridge``: Hugging Face causal LMs in and out of longspan, with Megatron Bridge's method names.

::

    from longspan import AutoBridge

    bridge = AutoBridge.from_hf_pretrained("path/to/hf_model")
    provider = bridge.to_megatron_provider()            # GPTModelProvider from config.json
    provider.tensor_model_parallel_size = 2             # any layout; then, inside the launched workers:
    model = provider.provide_distributed_model()        # list of chunks, HF weights loaded
    ...
    bridge.save_hf_pretrained(model, "out/hf")          # config.json + safetensors (one tensor at a time)
    for name, tensor in bridge.export_hf_weights(model): ...

    AutoBridge.import_ckpt("path/to/hf_model", "ckpt")  # a longspan checkpoint (iteration 0), no recipe
    bridge.export_ckpt("ckpt", "out/hf")                 # and back, in this bridge's architecture

Each rank reads only the slices of the HF tensors its parameters hold; see ``longspan.conversion.loader``.
``import_ckpt`` / ``export_ckpt`` write and read checkpoints through ``AutoBridge.checkpoint_format``, which the
training layer provides (``longspan.conversion.checkpoints`` says why); ``from longspan import AutoBridge``
gives the class with it plugged in.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

import longspan.conversion.families as families
from longspan.config.explicit import mark_model_family, model_family
from longspan.conversion.checkpoints import (
    HF_CONFIG_IN_CHECKPOINT,
    CheckpointFormat,
    ProgressLog,
    SavedModel,
    import_config,
    read_model_family,
)
from longspan.conversion.config_fields import DTYPE_NAMES
from longspan.conversion.families import Family
from longspan.conversion.loader import export_hf_weights, load_hf_weights, lookup
from longspan.conversion.mapping import match
from longspan.conversion.mtp_layers import (
    check_export,
    check_import,
    declared_depths,
    importable_depths,
    model_depths,
    with_depths,
)
from longspan.conversion.safetensors_io import (
    HFCheckpointReader,
    StreamingSafetensorsWriter,
    finalize_shards,
)
from longspan.config.schema.container import ConfigContainer
from longspan.config.schema.infra import DistributedInitConfig
from longspan.config.schema.training import TrainingConfig
from longspan.core.errors import CheckpointError, NotSupportedError
from longspan.core.logging import get_logger, get_rank, print_rank_0
from longspan.data.tokenizers import GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer
from longspan.models.builder import build_meta_model
from longspan.parallel import init as parallel_init
from longspan.parallel.parallelize import parallelize_model
from longspan.parallel.pipeline import build_pipeline_chunks

_log = get_logger(__name__)

# Tokenizers whose files an HF model directory can hold (Null and byte-level ones are described by config alone).
_HF_READABLE_TOKENIZERS = (HuggingFaceTokenizer, SentencePieceTokenizer, GPT2BPETokenizer)

CONFIG_FILE = "config.json"
#: a vision-language model's processor files (image processor settings, the processor's chat template), which
#: a longspan checkpoint imported from HF keeps beside its weights
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json",
                   "chat_template.jinja", "video_preprocessor_config.json")
#: what an imported checkpoint keeps of its HF directory beside the weights and gives back on export: the
#: processor files and transformers' generation defaults (sampling settings, end-of-sequence ids)
KEPT_HF_FILES = PROCESSOR_FILES + ("generation_config.json",)
#: tokenizer (and processor) files copied with the weights (whichever exist)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json") + PROCESSOR_FILES


def is_hf_model_dir(path: str | os.PathLike | None) -> bool:
    """True when ``path`` is a directory with an HF ``config.json`` and safetensors weights."""
    if not path:
        return False
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and (
        (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()
    )


def hf_pretrained_dir(cfg: ConfigContainer) -> Path | None:
    """``checkpoint.pretrained_checkpoint`` of a run configuration when it is an HF model directory, else None."""
    path = cfg.checkpoint.pretrained_checkpoint if cfg.checkpoint is not None else None
    return Path(path) if path and is_hf_model_dir(path) else None


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The config.json of HF model directory ``path`` (one-line ``CheckpointError`` when missing)."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"HF model directory {p} does not exist")
    cfg_file = p / CONFIG_FILE
    if not cfg_file.is_file():
        raise CheckpointError(f"{p} is not an HF model directory: it has no {CONFIG_FILE}")
    try:
        return json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({exc})") from None


class _ProvideDistributedModel:
    """``provider.provide_distributed_model(wrap_with_ddp=False)``: the bridge's model build, for this provider."""

    def __init__(self, bridge: "AutoBridge", provider: Any, load_weights: bool) -> None:
        self.bridge, self.provider, self.load_weights = bridge, provider, load_weights

    def __call__(self, wrap_with_ddp: bool = False, **kwargs: Any) -> list[nn.Module]:
        return self.bridge.to_megatron_model(wrap_with_ddp, provider=self.provider, load_weights=self.load_weights,
                                             **kwargs)

    def __deepcopy__(self, memo: dict) -> "_ProvideDistributedModel":
        # A deep-copied provider builds itself (copy.deepcopy records the new provider in memo first).
        return _ProvideDistributedModel(self.bridge, memo.get(id(self.provider), self.provider), self.load_weights)


class AutoBridge:
    """Converts one HF architecture (picked from ``config.json``'s ``architectures``) to and from longspan."""

    def __init__(self, hf_config: dict[str, Any], family: Family, hf_path: str | os.PathLike | None = None) -> None:
        self.hf_config = dict(hf_config)
        self.family = family.for_config(self.hf_config)
        self.hf_path = Path(hf_path) if hf_path is not None else None

    # ------------------------------------------------------------------------------------------- construction

    @classmethod
    def from_hf_pretrained(cls, path: str | os.PathLike, **_: Any) -> "AutoBridge":
        """A bridge for the HF model directory ``path`` (config.json + safetensors)."""
        cfg = read_hf_config(path)
        return cls(cfg, families.family_for_config(cfg), path)

    @classmethod
    def from_hf_config(cls, config: Any) -> "AutoBridge":
        """A bridge for an HF config (a ``transformers.PretrainedConfig`` or a config.json dict); no weights."""
        cfg = config if isinstance(config, dict) else config.to_dict()
        return cls(cfg, families.family_for_config(cfg))

    @classmethod
    def from_longspan_provider(cls, provider: Any, architecture: str | None = None) -> "AutoBridge":
        """A bridge that exports a longspan model (e.g. from the ``tiny`` recipe) as its matching HF architecture."""
        if architecture is not None:
            family = families.family_for_config({"architectures": [architecture]})
        else:
            family = families.family_for_provider(provider)
        return cls(families.hf_config_dict(family, provider), family)

    @classmethod
    def for_run(cls, cfg: Any, architecture: str | None = None, saved_in: str | os.PathLike | None = None
                ) -> "AutoBridge":
        """The bridge that exports a run's model (``cfg`` a ConfigContainer).

        Without ``architecture``: the HF config the checkpoint directory ``saved_in`` was imported from, else the
        family the model was built as (the checkpoint's ``model_family.json``, or ``cfg``'s recorded family: a
        family recipe's, an HF import's), with the HF directory the run started from
        (``checkpoint.pretrained_checkpoint``) as its config.json when it is that family, else the architecture
        inferred from ``cfg.model`` (``families.family_for_provider``). ``architecture`` picks the HF
        architecture (the imported config is still used when it is that architecture).
        """
        source = Path(saved_in) / HF_CONFIG_IN_CHECKPOINT if saved_in is not None else None
        if source is not None and source.is_file():
            try:
                imported = json.loads(source.read_text())
            except ValueError as exc:
                raise CheckpointError(f"{source} is not valid JSON ({exc})") from None
            if architecture is None or architecture in (imported.get("architectures") or []):
                return cls.from_hf_config(imported)
        recorded = (read_model_family(saved_in) if saved_in is not None else None) or model_family(cfg)
        hf_dir = hf_pretrained_dir(cfg)
        if hf_dir is not None and architecture is None:
            bridge = cls.from_hf_pretrained(hf_dir)
            if recorded is None or recorded == bridge.family.name:
                return bridge
        if architecture is None and recorded is not None:
            family = families.family_named(recorded)
            architecture = family.export_architecture or family.architecture
        return cls.from_longspan_provider(cfg.model, architecture)

    @staticmethod
    def list_supported_models() -> list[str]:
        """The HF ``architectures`` entries longspan converts."""
        return families.supported_architectures()

    @classmethod
    def supports(cls, config: Any) -> bool:
        """Whether an HF config (object, dict, or model directory) has a supported architecture."""
        if isinstance(config, (str, os.PathLike)):
            try:
                config = read_hf_config(config)
            except CheckpointError:
                return False
        cfg = config if isinstance(config, dict) else config.to_dict()
        return any(a in families.by_architecture() for a in cfg.get("architectures") or [])

    # ------------------------------------------------------------------------------------------- import

    @property
    def hf_vocab_size(self) -> int | None:
        if self.family.export_config is not None:  # a text tower: the vocabulary is the text model's
            return self.family.export_config(self.hf_config).get("vocab_size")
        # a vision-language model's config.json nests its text model's fields (transformers 5)
        return self.hf_config.get("vocab_size") or (self.hf_config.get("text_config") or {}).get("vocab_size")

    def to_megatron_provider(self, load_weights: bool = True, hf_path: str | os.PathLike | None = None) -> Any:
        """A ``GPTModelProvider`` whose architecture fields come from the HF config.

        Its ``provide_distributed_model(wrap_with_ddp=False)`` builds the chunks for the provider's layout
        and (with ``load_weights``) loads the HF weights into them.
        """
        if hf_path is not None:
            self.hf_path = Path(hf_path)
        provider = self._provider()
        provider.provide_distributed_model = _ProvideDistributedModel(self, provider, load_weights)
        return provider

    def _provider(self) -> Any:
        """The provider of the HF config's architecture, finalized (a plain dataclass: it serializes). With
        weights, ``mtp_num_layers`` counts the multi-token-prediction layers the files hold."""
        provider = self.family.provider_class(**self.family.to_provider(self.hf_config))
        if self.family.mtp_layers and self.hf_path is not None and declared_depths(self.hf_config):
            reader = HFCheckpointReader(self.hf_path, self.family.hf_prefix_aliases)
            try:
                provider.mtp_num_layers = importable_depths(reader, self.hf_config, self.family.architecture)
            finally:
                reader.close()
        provider.finalize()
        return provider

    def to_megatron_model(
        self,
        wrap_with_ddp: bool = False,
        *,
        provider: Any = None,
        load_weights: bool = True,
        cfg: Any = None,
        progress: Callable[[str], None] | None = None,
    ) -> list[nn.Module]:
        """The model chunks for the current layout with the HF weights loaded.

        Args:
            wrap_with_ddp: accepted for Megatron Bridge compatibility; the data-parallel plan is the one the
                layout asks for (DDP wrapper, or FSDP2 with ``dist.use_torch_fsdp2``) when dp > 1.
            provider: the provider to build (default: ``to_megatron_provider()``); its parallel fields are the
                layout.
            cfg: a ConfigContainer to take the layout (``model``, ``ddp``, ``dist``) from instead.
            progress: called with each parameter's name after it is loaded.

        Works on one process without ``torch.distributed`` initialized; under a launcher it initializes
        longspan's distributed state for the layout if nobody has.
        """
        if cfg is None:
            cfg = container_for(provider if provider is not None else self.to_megatron_provider())
        if parallel_init.is_initialized():
            parallel = parallel_init.get_parallel_state()
        else:
            parallel = parallel_init.initialize_distributed(cfg.dist, cfg.model)
        chunks = build_empty_model(cfg, parallel)
        if load_weights:
            self.load_weights_into(chunks, progress=progress)
        return chunks

    def load_weights_into(self, chunks: list[nn.Module], progress: Callable[[str], None] | None = None,
                          select: Callable[[str], bool] | None = None) -> int:
        """Copy this bridge's HF weights into already built chunks (any layout); returns the parameter count.

        ``select(longspan_name)`` False leaves a parameter alone."""
        if self.hf_path is None:
            raise CheckpointError("this bridge has no HF weights (it was made from a config): use from_hf_pretrained")
        reader = HFCheckpointReader(self.hf_path, self.family.hf_prefix_aliases)
        try:
            family, requested = self.family, model_depths(chunks)
            if family.mtp_layers or requested:
                check_import(reader, self.hf_config, requested, family.architecture)
                family = family.for_config(with_depths(self.hf_config, requested))
            return load_hf_weights(chunks, family, reader, self.hf_vocab_size, progress=progress, select=select)
        finally:
            reader.close()

    # ------------------------------------------------------------------------------------------- export

    def export_hf_weights(self, model: nn.Module | list[nn.Module], cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` one full tensor at a time for the HF tensors this rank's chunks hold.

        Collective under tensor/data parallel (each parameter is gathered in turn): call it on every rank.
        Under pipeline parallel each stage yields its own layers' tensors. Tensors may be views of the
        model's parameters: copy them if you keep them past the next step.
        """
        chunks = model if isinstance(model, list) else [model]
        family, config = self.export_family_and_config(model_depths(chunks))
        tied = bool(config.get("tie_word_embeddings", family.tie_word_embeddings_default))
        return export_hf_weights(chunks, family, self.hf_vocab_size, tied, cpu=cpu)

    def export_family_and_config(self, mtp_depths: int = 0) -> tuple[Family, dict[str, Any]]:
        """The family and config.json an export writes: the source's, or for the text tower of a bigger model
        (a vision-language model) the text model's; declaring the model's ``mtp_depths`` multi-token-prediction
        layers where the architecture stores them (``num_nextn_predict_layers``)."""
        if self.family.export_architecture is None:
            family, config = self.family, dict(self.hf_config)
            if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
                del config["quantization_config"]
                print_rank_0(f"{family.architecture}: the source's expert weights are MXFP4; the export writes them "
                             "decoded, in the model's dtype (MXFP4 export is not supported yet)", _log)
        else:
            config = self.family.export_config(self.hf_config)
            family = families.by_architecture()[self.family.export_architecture]
        check_export(family.mtp_layers, mtp_depths, family.architecture)
        if family.mtp_layers:
            config = with_depths(config, mtp_depths)
        return family.for_config(config), config

    def save_hf_pretrained(self, model: nn.Module | list[nn.Module], path: str | os.PathLike,
                           max_shard_size: int = 5 * 2**30, progress: Callable[[str], None] | None = None) -> None:
        """Write ``config.json`` and safetensors shards (and the tokenizer files of the source HF directory).

        Collective. Each pipeline stage's writer rank (first of its tensor/data-parallel group) streams its
        stage's tensors into its own shards; global rank 0 then names them and writes the index.
        """
        parallel = parallel_init.get_parallel_state() if parallel_init.is_initialized() else None
        distributed = parallel is not None and parallel.world_size > 1
        rank = parallel.rank if distributed else 0
        out = Path(path)
        writer_rank = _is_stage_writer(parallel) if distributed else True
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        _barrier(distributed)
        stage = parallel.pp_rank if distributed else 0
        writer = StreamingSafetensorsWriter(out, prefix=f"part{stage:05d}", max_shard_bytes=max_shard_size) \
            if writer_rank else None
        for name, tensor in self.export_hf_weights(model):
            if writer is not None:
                writer.add(name, tensor)
                if progress is not None:
                    progress(name)
        weight_map = writer.finish() if writer is not None else {}
        total = writer.total_bytes if writer is not None else 0
        if distributed:
            gathered: list[Any] = [None] * parallel.world_size
            dist.all_gather_object(gathered, (weight_map, total))
            weight_map, total = {}, 0
            for part, size in gathered:
                weight_map.update(part)
                total += size
        if rank == 0:
            finalize_shards(out, weight_map, total)
            config = self.export_family_and_config(model_depths(model if isinstance(model, list) else [model]))[1]
            dtype = _first_dtype(model)
            if dtype is not None:
                config["dtype"] = DTYPE_NAMES.get(dtype, "float32")
            config.pop("torch_dtype", None)
            (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            if self.hf_path is not None:
                copy_tokenizer_files(self.hf_path, out)
        _barrier(distributed)

    def hf_module_name(self, longspan_module_name: str) -> str | None:
        """The HF module path of a longspan ``nn.Linear`` that maps one-to-one, or None.

        ``decoder.layers.3.self_attention.linear_q`` -> ``model.layers.3.self_attn.q_proj``. Fused (GPT-2
        ``c_attn``), transposed (``Conv1D``) and per-expert tensors have no one-to-one module.
        """
        found = match(self.family.weights, f"{longspan_module_name}.weight")
        if found is None:
            return None
        entry, layer = found
        if entry.transpose or entry.split or entry.per_expert or not entry.hf.endswith(".weight"):
            return None
        return entry.hf_name(layer)[: -len(".weight")]

    def hf_row_block(self, longspan_module_name: str) -> tuple[str, int, int] | None:
        """(HF module path, k, n) when the weight of longspan ``nn.Linear`` ``longspan_module_name`` is the k-th of
        n contiguous row blocks of one HF module's weight (a Mamba mixer's ``in_proj`` segments, Phi-3's
        ``qkv_proj``), else None (one-to-one, transposed, interleaved or per-expert tensors)."""
        found = match(self.family.weights, f"{longspan_module_name}.weight")
        if found is None:
            return None
        entry, layer = found
        if (entry.split is None or entry.transpose or entry.per_expert or entry.stacked or entry.split_groups
                or not entry.hf.endswith(".weight")):
            return None
        return (entry.hf_name(layer)[: -len(".weight")], *entry.split)

    # ------------------------------------------------------------------------------------------- checkpoints

    #: writes and reads longspan checkpoints for ``import_ckpt`` / ``export_ckpt``; the training layer provides
    #: it and ``from longspan import AutoBridge`` plugs it in (this package sits below training)
    checkpoint_format: ClassVar[CheckpointFormat | None] = None

    @classmethod
    def import_ckpt(cls, hf_path: str | os.PathLike, megatron_path: str | os.PathLike, overrides: Sequence[str] = (),
                    *, show_progress: bool = False) -> Path:
        """Write the HF model at ``hf_path`` as a longspan checkpoint (iteration 0) under ``megatron_path``.

        Everything comes from the HF directory (``checkpoints.import_config``): the architecture, dtype and
        tokenizer; the checkpoint holds the weights, run_config.yaml, the tokenizer files, the tracker and the
        HF config.json it came from (``hf_config.json``, for the export). ``overrides``: dotlist strings, e.g.
        the layout (``model.tensor_model_parallel_size=2``); under a launch each rank reads only its slices.
        Runs on every rank of a launch.
        """
        checkpoint_format = cls._checkpoint_format("import_ckpt")
        bridge = cls.from_hf_pretrained(hf_path)
        cfg = import_config(bridge._provider(), hf_path, megatron_path, overrides)
        mark_model_family(cfg, bridge.family.name)  # the checkpoint records it (model_family.json)
        parallel = parallel_init.initialize_distributed(
            cfg.dist, cfg.model, dp_replicate=cfg.ddp.num_distributed_optimizer_instances)
        model = build_empty_model(cfg, parallel)
        progress = ProgressLog(_count_tensors(model), "import", enabled=show_progress and parallel.rank == 0)
        try:
            bridge.load_weights_into(model, progress=progress)
        finally:
            progress.close()
        iter_dir = checkpoint_format.save_model(cfg, model, parallel)
        if parallel.rank == 0:
            shutil.copyfile(Path(hf_path) / CONFIG_FILE, iter_dir / HF_CONFIG_IN_CHECKPOINT)
            copy_tokenizer_files(hf_path, iter_dir, KEPT_HF_FILES)  # for the export and generation with images
            print_rank_0(f"imported {hf_path} ({bridge.family.architecture}, {cfg.model.num_layers} layers) "
                         f"into {megatron_path} (iteration 0)", _log)
        return Path(megatron_path)

    def export_ckpt(self, megatron_path: str | os.PathLike, hf_path: str | os.PathLike, overrides: Sequence[str] = (),
                    *, show_progress: bool = False) -> Path:
        """Write the longspan checkpoint at ``megatron_path`` as an HF model directory ``hf_path`` in this
        bridge's architecture (see ``export_checkpoint``)."""
        return self.export_checkpoint(megatron_path, hf_path, overrides, architecture=self.family.architecture,
                                      show_progress=show_progress)

    @classmethod
    def export_checkpoint(cls, megatron_path: str | os.PathLike, hf_path: str | os.PathLike,
                          overrides: Sequence[str] = (), *, architecture: str | None = None,
                          show_progress: bool = False) -> Path:
        """A longspan checkpoint (save root or ``iter_`` directory) -> an HF model directory ``hf_path``.

        The HF architecture and config.json are the ones the checkpoint was imported from, else the matching
        ones (``for_run``; ``architecture`` forces one). An adapter checkpoint exports merged. ``overrides``
        apply to the saved run_config.yaml (e.g. the layout of a launch). Runs on every rank of a launch.
        """
        saved = cls._checkpoint_format("export_ckpt").load_model(megatron_path, overrides)
        bridge = cls.for_run(saved.cfg, architecture, saved_in=saved.directory)
        progress = ProgressLog(_count_tensors(saved.model), "export", enabled=show_progress and get_rank() == 0)
        try:
            bridge.save_hf_pretrained(saved.model, hf_path, progress=progress)
        finally:
            progress.close()
        if get_rank() == 0:
            _write_tokenizer(saved, hf_path)
            copy_tokenizer_files(saved.directory, hf_path, KEPT_HF_FILES)
            print_rank_0(f"exported {megatron_path} (iteration {saved.iteration}) as {bridge.family.architecture} "
                         f"to {hf_path}", _log)
        return Path(hf_path)

    @classmethod
    def _checkpoint_format(cls, method: str) -> CheckpointFormat:
        if cls.checkpoint_format is None:
            raise NotSupportedError(
                f"AutoBridge.{method} needs longspan's checkpoint format, which the training layer provides: "
                "use `from longspan import AutoBridge` (it plugs the format in)"
            )
        return cls.checkpoint_format


# ----------------------------------------------------------------------------------------------- helpers


def _count_tensors(model: list[nn.Module]) -> int:
    return sum(1 for chunk in model for _ in chunk.parameters())


def _write_tokenizer(saved: SavedModel, hf_path: str | os.PathLike) -> None:
    """The checkpoint's tokenizer files into the HF directory, when transformers can read them."""
    if isinstance(saved.tokenizer, _HF_READABLE_TOKENIZERS):
        saved.tokenizer.save_files(str(hf_path))


def container_for(provider: Any) -> ConfigContainer:
    """A run configuration for building ``provider``'s model (what that reads: ``model``, ``ddp``, ``dist``,
    ``optimizer``, ``train.micro_batch_size``), with defaults: the layout is the provider's parallel fields."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return ConfigContainer(model=provider, dist=DistributedInitConfig(distributed_backend=backend),
                           train=TrainingConfig(micro_batch_size=1))


def build_empty_model(cfg: Any, parallel: Any) -> list[nn.Module]:
    """The model chunks for ``cfg``'s layout (parallel plans applied), materialized but not initialized."""
    provider = copy.copy(cfg.model)
    provider.perform_initialization = False
    shadow = copy.copy(cfg)
    shadow.model = provider
    if parallel.pp_size > 1:
        return build_pipeline_chunks(shadow, parallel, seed=0)
    model = build_meta_model(provider)
    model = parallelize_model(model, shadow, parallel)
    model.to_empty(device=parallel.device)
    return [model]


def _is_stage_writer(parallel: Any) -> bool:
    """The rank that writes its pipeline stage's tensors: coordinate 0 on every mesh dimension but pp."""
    mesh = parallel.mesh
    names = mesh.mesh_dim_names
    return all(mesh.get_local_rank(d) == 0 for d in names if d != "pp" and mesh.size(names.index(d)) > 1)


def _barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def _first_dtype(model: nn.Module | list[nn.Module]) -> torch.dtype | None:
    chunks = model if isinstance(model, list) else [model]
    for chunk in chunks:
        for param in chunk.parameters():
            return param.dtype
    return None


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike,
                         names: Sequence[str] = TOKENIZER_FILES) -> list[str]:
    """Copy the tokenizer files (``names``: whichever exist) of an HF (or longspan tokenizer) directory; returns
    the names copied."""
    copied = []
    for name in names:
        f = Path(src) / name
        if f.is_file():
            shutil.copyfile(f, Path(dst) / name)
            copied.append(name)
    return copied


__all__ = ["AutoBridge", "hf_pretrained_dir", "is_hf_model_dir", "read_hf_config", "lookup"]
