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

Each rank reads only the slices of the HF tensors its parameters hold; see ``longspan.conversion.loader``.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch
from torch import nn

import longspan.conversion.families as families
from longspan.conversion.config_fields import DTYPE_NAMES
from longspan.conversion.families import Family
from longspan.conversion.loader import export_hf_weights, load_hf_weights, lookup
from longspan.conversion.safetensors_io import (
    HFCheckpointReader,
    StreamingSafetensorsWriter,
    finalize_shards,
)
from longspan.core.errors import CheckpointError
from longspan.core.logging import get_logger, print_rank_0

_log = get_logger(__name__)

CONFIG_FILE = "config.json"
#: tokenizer files copied with the weights (whichever exist)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def is_hf_model_dir(path: str | os.PathLike | None) -> bool:
    """True when ``path`` is a directory with an HF ``config.json`` and safetensors weights."""
    if not path:
        return False
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and (
        (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()
    )


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
        return any(a in families.BY_ARCHITECTURE for a in cfg.get("architectures") or [])

    # ------------------------------------------------------------------------------------------- import

    @property
    def hf_vocab_size(self) -> int | None:
        if self.family.export_config is not None:  # a text tower: the vocabulary is the text model's
            return self.family.export_config(self.hf_config).get("vocab_size")
        return self.hf_config.get("vocab_size")

    def to_megatron_provider(self, load_weights: bool = True, hf_path: str | os.PathLike | None = None) -> Any:
        """A ``GPTModelProvider`` whose architecture fields come from the HF config.

        Its ``provide_distributed_model(wrap_with_ddp=False)`` builds the chunks for the provider's layout
        and (with ``load_weights``) loads the HF weights into them.
        """
        import longspan.models as models

        if hf_path is not None:
            self.hf_path = Path(hf_path)
        provider = getattr(models, self.family.provider_class)(**self.family.to_provider(self.hf_config))
        provider.finalize()
        provider.provide_distributed_model = _ProvideDistributedModel(self, provider, load_weights)
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
        from longspan.parallel import init as parallel_init

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
            return load_hf_weights(chunks, self.family, reader, self.hf_vocab_size, progress=progress, select=select)
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
        family, config = self.export_family_and_config()
        tied = bool(config.get("tie_word_embeddings", family.name == "gpt2"))
        return export_hf_weights(chunks, family, self.hf_vocab_size, tied, cpu=cpu)

    def export_family_and_config(self) -> tuple[Family, dict[str, Any]]:
        """The family and config.json an export writes: the source's, or for the text tower of a bigger model
        (a vision-language model) the text model's."""
        if self.family.export_architecture is None:
            return self.family, dict(self.hf_config)
        config = self.family.export_config(self.hf_config)
        return families.BY_ARCHITECTURE[self.family.export_architecture].for_config(config), config

    def save_hf_pretrained(self, model: nn.Module | list[nn.Module], path: str | os.PathLike,
                           max_shard_size: int = 5 * 2**30, progress: Callable[[str], None] | None = None) -> None:
        """Write ``config.json`` and safetensors shards (and the tokenizer files of the source HF directory).

        Collective. Each pipeline stage's writer rank (first of its tensor/data-parallel group) streams its
        stage's tensors into its own shards; global rank 0 then names them and writes the index.
        """
        from longspan.parallel import init as parallel_init

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
            import torch.distributed as dist

            gathered: list[Any] = [None] * parallel.world_size
            dist.all_gather_object(gathered, (weight_map, total))
            weight_map, total = {}, 0
            for part, size in gathered:
                weight_map.update(part)
                total += size
        if rank == 0:
            finalize_shards(out, weight_map, total)
            config = self.export_family_and_config()[1]
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
        from longspan.conversion.mapping import match

        found = match(self.family.weights, f"{longspan_module_name}.weight")
        if found is None:
            return None
        entry, layer = found
        if entry.transpose or entry.split or entry.per_expert or not entry.hf.endswith(".weight"):
            return None
        return entry.hf_name(layer)[: -len(".weight")]


# ----------------------------------------------------------------------------------------------- helpers


def container_for(provider: Any) -> Any:
    """The parts of a run's configuration that building a model reads (``model``, ``ddp``, ``dist``,
    ``optimizer``, ``train.micro_batch_size``), with defaults: the layout is the provider's parallel fields."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return SimpleNamespace(model=provider, ddp=SimpleNamespace(), optimizer=None,
                           dist=SimpleNamespace(distributed_backend=backend), train=SimpleNamespace(micro_batch_size=1))


def build_empty_model(cfg: Any, parallel: Any) -> list[nn.Module]:
    """The model chunks for ``cfg``'s layout (parallel plans applied), materialized but not initialized."""
    from longspan.models.builder import build_meta_model
    from longspan.parallel.parallelize import parallelize_model
    from longspan.parallel.pipeline import build_pipeline_chunks

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
        import torch.distributed as dist

        dist.barrier()


def _first_dtype(model: nn.Module | list[nn.Module]) -> torch.dtype | None:
    chunks = model if isinstance(model, list) else [model]
    for chunk in chunks:
        for param in chunk.parameters():
            return param.dtype
    return None


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer files of an HF (or longspan tokenizer) directory; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        f = Path(src) / name
        if f.is_file():
            shutil.copyfile(f, Path(dst) / name)
            copied.append(name)
    return copied


class ProgressLog:
    """tqdm when installed, else a rank-0 log line every ``every`` items."""

    def __init__(self, total: int, desc: str, enabled: bool = True, every: int = 50) -> None:
        self.total, self.desc, self.enabled, self.every = total, desc, enabled, every
        self.count = 0
        self.start = time.time()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, unit="tensor", leave=False)
            except ImportError:
                pass

    def __call__(self, _name: str) -> None:
        self.count += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
        elif self.count % self.every == 0 or self.count == self.total:
            print_rank_0(f"{self.desc}: {self.count}/{self.total} tensors ({time.time() - self.start:.1f}s)", _log)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


__all__ = ["AutoBridge", "is_hf_model_dir", "read_hf_config", "lookup"]
