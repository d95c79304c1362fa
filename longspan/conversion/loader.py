"""The one loader and exporter shared by every family: walk the model's parameters, look each up in the
family's ``WeightMap`` table, and move only the needed part of each tensor.

Import: for every local parameter (plain, or a DTensor sharded by tensor/expert/data parallel plans) the part
this process holds is a box ``[offset, offset + local_shape)`` of the full tensor (torch's
``compute_local_shape_and_global_offset``); the box is translated through the mapping rule (transpose, fused
rows, per-expert files, vocabulary padding) into slices of the HF tensors and only those are read.
Placements that do not give a box (strided FSDP-over-TP shards) read the full tensor and keep their part.

Export: parameters are gathered one at a time (``DTensor.full_tensor()``, a collective over the parameter's
mesh, so every rank of a pipeline stage walks its parameters in the same order) and turned back into HF
tensors; a fused HF tensor (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``) is emitted once all its parts were seen.

Persistent buffers (the routers' float32 ``expert_bias``) follow the parameters: each needs a table entry
flagged ``buffer`` and is copied whole, keeping its dtype, so it round-trips bit-exactly.

An entry's ``copies`` (the embedding and output head a multi-token-prediction layer repeats) are read for the
same part as the parameter on import and must equal it bit for bit; the export writes the tensor under each.
A last pipeline stage's own embedding (multi-token prediction needs one there) is the first stage's: only the
first stage exports it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch
from torch import nn

from longspan.conversion.families import Family
from longspan.conversion.mapping import WeightMap, match
from longspan.conversion.mxfp4 import dequantize_mxfp4
from longspan.conversion.safetensors_io import HFCheckpointReader
from longspan.core.errors import CheckpointError
from longspan.core.logging import get_logger
from longspan.models.init import canonical_parameter_name, parameter_stream_name

_log = get_logger(__name__)

Box = tuple[slice, ...]


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor  # slow to import; already loaded wherever a DTensor exists

    return isinstance(t, DTensor)


def iter_named_parameters(chunks: list[nn.Module]) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """(canonical name, owning module, parameter name, parameter) of every chunk, each tensor once.

    A tied output copy on a last pipeline stage is named after the word embeddings it copies.
    """
    seen: set[int] = set()
    for chunk in chunks:
        for module_name, module in chunk.named_modules():
            overrides = getattr(module, "init_name_overrides", {})
            for param_name, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                yield parameter_stream_name(module_name, param_name, overrides), module, param_name, param


def iter_named_buffers(chunks: list[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, buffer) of every persistent buffer of the chunks, each tensor once."""
    seen: set[int] = set()
    for chunk in chunks:
        for module_name, module in chunk.named_modules():
            for buffer_name, buffer in module.named_buffers(recurse=False):
                if buffer is None or id(buffer) in seen or buffer_name in module._non_persistent_buffers_set:
                    continue
                seen.add(id(buffer))
                full = f"{module_name}.{buffer_name}" if module_name else buffer_name
                yield canonical_parameter_name(full), buffer


def lookup(family: Family, name: str, buffer: bool = False) -> tuple[WeightMap, int | None]:
    found = match(family.weights, name)
    kind = "buffer" if buffer else "parameter"
    if found is None or found[0].buffer != buffer:
        raise CheckpointError(f"longspan {kind} {name} has no {family.architecture} equivalent")
    return found


def _local_box(param: torch.Tensor) -> Box | None:
    """The box of the full tensor this process holds, or None when it is not a box (read all, then shard)."""
    shape = tuple(param.shape)
    if not _is_dtensor(param):
        return tuple(slice(0, n) for n in shape)
    from torch.distributed.tensor import Replicate, Shard  # slow to import; already loaded wherever a DTensor exists
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # (the same)

    if not all(type(p) in (Shard, Replicate) for p in param.placements):
        return None
    local_shape, offset = compute_local_shape_and_global_offset(shape, param.device_mesh, param.placements)
    if tuple(local_shape) != tuple(param.to_local().shape):
        return None
    return tuple(slice(o, o + n) for o, n in zip(offset, local_shape))


def expected_hf_shape(entry: WeightMap, shape: tuple[int, ...], hf_vocab: int | None) -> tuple[int, ...]:
    """The HF tensor's full shape for a longspan parameter of full ``shape``."""
    shape = tuple(shape)
    if entry.per_expert:
        shape = shape[1:]
    if entry.vocab and hf_vocab is not None:
        shape = (hf_vocab,) + shape[1:]
    if entry.split is not None:
        shape = (entry.split_rows(shape[0])[1],) + shape[1:]
    if entry.transpose:
        shape = shape[::-1]
    return shape


def _read_box(reader: HFCheckpointReader, hf_name: str, entry: WeightMap, box: Box, rows: int) -> torch.Tensor:
    """``box`` of the longspan-oriented tensor (one expert / one split block) read from HF tensor ``hf_name``.

    ``rows`` is the size of dim 0 of the longspan-oriented block (for the split offset).
    """
    if entry.split is not None and entry.split_groups:
        # a per-group interleaved fusion: ours' rows are pieces of several HF row ranges
        pieces = [_read_box(reader, hf_name, dataclasses.replace(entry, split=None, split_groups=None),
                            (rows_slice,) + box[1:], rows)
                  for rows_slice in entry.hf_row_slices(box[0].start, box[0].stop, rows)]
        if not pieces:
            return reader.read(hf_name, (slice(0, 0),) + box[1:])
        return torch.cat(pieces)
    if entry.split is not None:
        start = entry.split_rows(rows)[0]
        box = (slice(box[0].start + start, box[0].stop + start),) + box[1:]
    if entry.transpose:
        return reader.read(hf_name, box[::-1]).t()
    return reader.read(hf_name, box)


def read_parameter_part(
    reader: HFCheckpointReader, entry: WeightMap, layer: int | None, name: str, full_shape: tuple[int, ...], box: Box,
    hf_vocab: int | None,
) -> torch.Tensor:
    """The part ``box`` of longspan parameter ``name`` (full shape ``full_shape``), read from the HF files."""
    if entry.stacked:
        return _read_stacked_part(reader, entry, layer, name, full_shape, box)
    first_hf = entry.hf_name(layer, 0 if entry.per_expert else None)
    want = expected_hf_shape(entry, full_shape, hf_vocab)
    have = reader.shape(first_hf)
    if tuple(have) != tuple(want):
        raise CheckpointError(
            f"shape mismatch: HF tensor {first_hf} has shape {tuple(have)} but longspan's {name} needs {tuple(want)}"
        )
    if entry.per_expert:
        parts = [
            _read_box(reader, entry.hf_name(layer, e), entry, box[1:], full_shape[1])
            for e in range(box[0].start, box[0].stop)
        ]
        return torch.stack(parts) if parts else torch.empty((0,) + tuple(s.stop - s.start for s in box[1:]))
    if entry.vocab and hf_vocab is not None and box[0].stop > hf_vocab:
        # Padding rows beyond the HF vocabulary (make_vocab_size_divisible_by) start as zeros: no token id
        # reaches them, and the export drops them again.
        stop = min(box[0].stop, hf_vocab)
        start = min(box[0].start, stop)
        real = _read_box(reader, entry.hf_name(layer), entry, (slice(start, stop),) + box[1:], full_shape[0])
        pad = torch.zeros((box[0].stop - box[0].start - real.shape[0],) + tuple(real.shape[1:]), dtype=real.dtype)
        return torch.cat([real, pad])
    return _read_box(reader, entry.hf_name(layer), entry, box, full_shape[0])


def _read_stacked_part(reader: HFCheckpointReader, entry: WeightMap, layer: int | None, name: str,
                       full_shape: tuple[int, ...], box: Box) -> torch.Tensor:
    """``box`` of an expert slab held by one HF tensor for all experts (plain or MXFP4): the experts of the box
    are read whole, turned to longspan's orientation, de-interleaved, then cut to the box."""
    hf_name = entry.hf_name(layer)
    experts = (box[0],)
    n = entry.interleave[1] if entry.interleave else entry.split[1] if entry.split else 1
    want = (full_shape[0], full_shape[1] * n) + tuple(full_shape[2:])
    if hf_name in reader or not entry.mxfp4:
        have = tuple(reader.shape(hf_name))
        oriented = have[:1] + have[1:][::-1] if entry.transpose else have
        if oriented != want:
            raise CheckpointError(f"shape mismatch: HF tensor {hf_name} has shape {have} but longspan's {name} "
                                  f"needs {want[:1] + want[1:][::-1] if entry.transpose else want}")
        full = reader.read(hf_name, experts)
        full = full.transpose(1, 2) if entry.transpose else full
    else:
        blocks_name, scales_name = f"{hf_name}_blocks", f"{hf_name}_scales"
        if blocks_name not in reader or scales_name not in reader:
            raise CheckpointError(f"HF tensor {hf_name} is missing (neither it nor {blocks_name} / {scales_name})")
        blocks, scales = reader.shape(blocks_name), reader.shape(scales_name)
        if tuple(blocks[:-1]) != tuple(scales):
            raise CheckpointError(f"MXFP4 tensor {hf_name}: {scales_name} has shape {tuple(scales)} but "
                                  f"{blocks_name} {tuple(blocks)} needs {tuple(blocks[:-1])}")
        decoded = tuple(blocks[:-2]) + (blocks[-2] * blocks[-1] * 2,)
        if decoded != want:
            raise CheckpointError(f"shape mismatch: MXFP4 tensor {hf_name} decodes to {decoded} but longspan's "
                                  f"{name} needs {want}")
        full = dequantize_mxfp4(reader.read(blocks_name, experts), reader.read(scales_name, experts), hf_name)
    if entry.interleave:
        full = full[:, entry.interleave[0]::n]
    elif entry.split:
        rows = full_shape[1]
        full = full[:, entry.split[0] * rows:(entry.split[0] + 1) * rows]
    return full[(slice(None),) + tuple(box[1:])].contiguous()


@torch.no_grad()
def load_hf_weights(chunks: list[nn.Module], family: Family, reader: HFCheckpointReader, hf_vocab: int | None,
                    progress: Any = None, select: Callable[[str], bool] | None = None) -> int:
    """Copy the HF weights into every parameter of ``chunks`` (in place, any layout). Returns the count.

    ``select(name)`` False skips a parameter (adapters that a later load fills).
    """
    count = 0
    for name, _module, _pname, param in iter_named_parameters(chunks):
        if select is not None and not select(name):
            continue
        entry, layer = lookup(family, name)
        full_shape = tuple(param.shape)
        box = _local_box(param)
        if box is None:
            from torch.distributed.tensor import distribute_tensor  # slow to import; already loaded wherever a DTensor exists

            whole = tuple(slice(0, n) for n in full_shape)
            full = read_parameter_part(reader, entry, layer, name, full_shape, whole, hf_vocab)
            _check_copies(reader, entry, layer, name, full_shape, whole, hf_vocab, full)
            local = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements,
                                      src_data_rank=None).to_local()
        else:
            local = read_parameter_part(reader, entry, layer, name, full_shape, box, hf_vocab)
            _check_copies(reader, entry, layer, name, full_shape, box, hf_vocab, local)
        target = param.to_local() if _is_dtensor(param) else param
        if tuple(local.shape) != tuple(target.shape):
            raise CheckpointError(f"{name}: read a part of shape {tuple(local.shape)} for a shard of {tuple(target.shape)}")
        target.copy_(local.to(dtype=target.dtype))
        count += 1
        if progress is not None:
            progress(name)
    return count + _load_buffers(chunks, family, reader, progress, select)


def _check_copies(reader: HFCheckpointReader, entry: WeightMap, layer: int | None, name: str,
                  full_shape: tuple[int, ...], box: Box, hf_vocab: int | None, part: torch.Tensor) -> None:
    """The same ``box`` of every copy of ``entry``'s HF tensor equals ``part`` (what ``name`` loaded) bit for bit."""
    for copy in entry.copies:
        other = read_parameter_part(reader, dataclasses.replace(entry, hf=copy, copies=()), layer, name, full_shape,
                                    box, hf_vocab)
        if other.dtype != part.dtype or not torch.equal(other, part):
            differ = (other.float() - part.float()).abs().max().item()
            raise CheckpointError(
                f"HF tensor {copy} differs from {entry.hf_name(layer)} (max |difference| {differ:.3g}): longspan's "
                f"multi-token-prediction layers share the model's {name}; import with mtp_num_layers=None to "
                "leave them out"
            )


def _load_buffers(chunks: list[nn.Module], family: Family, reader: HFCheckpointReader, progress: Any,
                  select: Callable[[str], bool] | None) -> int:
    """Copy every persistent buffer whole from its HF tensor (buffers are replicated, never sharded)."""
    count = 0
    for name, buffer in iter_named_buffers(chunks):
        if select is not None and not select(name):
            continue
        entry, layer = lookup(family, name, buffer=True)
        hf_name = entry.hf_name(layer)
        if tuple(reader.shape(hf_name)) != tuple(buffer.shape):
            raise CheckpointError(f"shape mismatch: HF tensor {hf_name} has shape {tuple(reader.shape(hf_name))} "
                                  f"but longspan's {name} needs {tuple(buffer.shape)}")
        full = reader.read(hf_name)
        target = buffer.to_local() if _is_dtensor(buffer) else buffer
        target.copy_(full.to(dtype=target.dtype))
        count += 1
        if progress is not None:
            progress(name)
    return count


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if _is_dtensor(param) else param


@torch.no_grad()
def export_hf_weights(chunks: list[nn.Module], family: Family, hf_vocab: int | None, tied: bool,
                      cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every HF tensor this process's chunks hold, one full tensor at a time.

    Collective: every rank of a pipeline stage must iterate. With ``tied`` the output layer is not exported
    (HF stores the tied ``lm_head`` once, as the embeddings).
    """
    pending: dict[str, dict[int, torch.Tensor]] = {}
    stage_copies = _last_stage_embedding_copies(chunks)
    for name, module, pname, param in iter_named_parameters(chunks):
        entry, layer = lookup(family, name)
        is_copy = getattr(module, "init_name_overrides", {}).get(pname) is not None or id(param) in stage_copies
        full = _full(param)
        if is_copy or (tied and name == "output_layer.weight"):
            continue  # the first stage exports the embeddings this copies
        full = full.detach()
        if cpu:
            full = full.cpu()
        if entry.vocab and hf_vocab is not None:
            full = full[:hf_vocab]
        if entry.per_expert:
            for e in range(full.shape[0]):
                yield entry.hf_name(layer, e), _to_hf(entry, full[e])
            continue
        hf_name = entry.hf_name(layer)
        if entry.stacked:
            stacked = _stacked_to_hf(entry, full, pending.setdefault(hf_name, {}))
            if stacked is not None:
                del pending[hf_name]
                yield hf_name, stacked
            continue
        if entry.split is not None:
            parts = pending.setdefault(hf_name, {})
            parts[entry.split[0]] = full
            if len(parts) < entry.split[1]:
                continue
            full = _fuse(entry, [parts[k] for k in range(entry.split[1])])
            del pending[hf_name]
        tensor = _to_hf(entry, full)
        yield hf_name, tensor
        for copy in entry.copies:
            yield copy, tensor
    if pending:
        raise CheckpointError(f"incomplete fused HF tensors (some parts are on no chunk): {sorted(pending)}")
    for name, buffer in iter_named_buffers(chunks):
        entry, layer = lookup(family, name, buffer=True)
        full = _full(buffer).detach()
        yield entry.hf_name(layer), (full.cpu() if cpu else full).clone()


def _last_stage_embedding_copies(chunks: list[nn.Module]) -> set[int]:
    """ids of the embedding parameters a pipeline stage without the input layer holds as the first stage's copy
    (multi-token prediction's, ``GPTModel``)."""
    out: set[int] = set()
    for chunk in chunks:
        while isinstance(getattr(chunk, "module", None), nn.Module):  # a DDP wrapper
            chunk = chunk.module
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None and getattr(chunk, "pre_process", True) is False:
            out.update(id(p) for p in embedding.parameters())
    return out


def _fuse(entry: WeightMap, parts: list[torch.Tensor]) -> torch.Tensor:
    """The HF tensor of a split entry from its blocks: stacked, or interleaved group by group."""
    if not entry.split_groups:
        return torch.cat(parts)
    groups = entry.split_groups
    grouped = [p.reshape(groups, p.shape[0] // groups, *p.shape[1:]) for p in parts]
    return torch.cat(grouped, dim=1).reshape(-1, *parts[0].shape[1:])


def _to_hf(entry: WeightMap, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.t().contiguous() if entry.transpose else tensor.contiguous()


def _stacked_to_hf(entry: WeightMap, full: torch.Tensor, parts: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The HF tensor of a stacked expert entry once all its interleaved (or split) parts were seen (None before)."""
    if entry.split:
        k, n = entry.split
        parts[k] = full
        if len(parts) < n:
            return None
        full = torch.cat([parts[j] for j in range(n)], dim=1)
    elif entry.interleave:
        k, n = entry.interleave
        parts[k] = full
        if len(parts) < n:
            return None
        first = parts[0]
        full = first.new_empty((first.shape[0], first.shape[1] * n) + tuple(first.shape[2:]))
        for j in range(n):
            full[:, j::n] = parts[j]
    return (full.transpose(1, 2) if entry.transpose else full).contiguous()

