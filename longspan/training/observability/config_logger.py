"""``model.config_logger_dir``: megatron-core's config logger (``megatron.core.config_logger``) for the built model.

Megatron writes, when each model is built, ``{dir}/{ModelClass}.rank_{tp}_{dp}_{cp}_{pp}_{ep}.iter{n}.json`` on
every rank (n counts the models of that name the rank built: one per virtual pipeline chunk), holding the
model's constructor arguments: its config and the layer structure. longspan writes the same file names with
the resolved provider config (``config``), where the chunk sits (``pre_process``, ``post_process``,
``vp_stage``, ``layer_numbers``) and the module tree (``modules``: each module's children, a leaf as its repr,
as Megatron's encoder writes modules).
"""

from __future__ import annotations

import json
import os
from typing import Any

from torch import nn

from longspan.config.serialize import to_dict
from longspan.models.gpt_provider import TransformerConfig
from longspan.parallel.pipeline import chunk_info, unwrap_chunk


def module_tree(module: nn.Module) -> Any:
    """A module as megatron-core's JSON encoder writes it: a dict of its children, or its repr for a leaf."""
    children = dict(module.named_children())
    if not children:
        return str(module)
    return {name: module_tree(child) for name, child in children.items()}


def _json_safe(value: Any) -> Any:
    return str(value)


def log_model_configs(model_config: TransformerConfig, chunks: list[nn.Module], parallel: Any) -> list[str]:
    """Write one JSON file per model chunk under ``model_config.config_logger_dir`` (nothing when it is empty);
    returns the paths written."""
    directory = model_config.config_logger_dir
    if not directory:
        return []
    os.makedirs(directory, exist_ok=True)
    rank_str = "_".join(str(r) for r in (parallel.tp_rank, parallel.dp_rank, parallel.cp_rank, parallel.pp_rank,
                                           parallel.ep_rank))
    config = to_dict(model_config)
    paths = []
    for vp_stage, chunk in enumerate(chunks):
        module = unwrap_chunk(chunk)
        info = chunk_info(chunk)
        record = {
            "config": config,
            "pre_process": info.is_first if info is not None else True,
            "post_process": info.is_last if info is not None else True,
            "vp_stage": vp_stage if len(chunks) > 1 else None,
            "layer_numbers": list(info.layer_numbers) if info is not None else None,
            "modules": module_tree(module),
        }
        path = os.path.join(directory, f"{type(module).__name__}.rank_{rank_str}.iter{vp_stage}.json")
        with open(path, "w") as fp:
            json.dump(record, fp, default=_json_safe, indent=1)
        paths.append(path)
    return paths


__all__ = ["log_model_configs", "module_tree"]
