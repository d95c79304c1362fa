"""How a model's transformer layers split over pipeline stages: Megatron's layout arithmetic, no torch.

Layout (Megatron's): the layers are split over ``pp × vp`` virtual stages; virtual stage ``s`` lives on pipeline
rank ``s % pp`` as its model chunk ``s // pp``. ``num_layers_in_first_pipeline_stage`` /
``num_layers_in_last_pipeline_stage`` fix the first / last pipeline rank's layer counts and the other ranks share
the rest evenly; ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split`` count the
embedding / loss as one layer of the first / last stage. validate() checks a config's split with it;
``longspan.parallel.pipeline`` cuts the model with it.
"""

from __future__ import annotations

from typing import Any

from longspan.core.errors import ConfigError


def _per_rank_layer_counts(
    num_layers: int, pp: int, first: int | None, last: int | None, model_field: str = "model"
) -> list[int]:
    """Transformer layers per pipeline rank with Megatron's uneven-split fields (no embedding/loss slots)."""
    counts: list[int | None] = [None] * pp
    if first is not None:
        if first < 0 or (pp == 1 and first != num_layers):
            raise ConfigError(f"{model_field}.num_layers_in_first_pipeline_stage={first} is invalid for "
                              f"num_layers={num_layers} and pipeline_model_parallel_size={pp}")
        counts[0] = first
    if last is not None:
        if last < 0 or pp < 2:
            raise ConfigError(f"{model_field}.num_layers_in_last_pipeline_stage={last} needs "
                              f"pipeline_model_parallel_size > 1 (it is {pp}) and a non-negative value")
        counts[-1] = last
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    rest = num_layers - fixed
    if rest < 0 or (free and rest % len(free) != 0) or (not free and rest != 0):
        raise ConfigError(
            f"{model_field}.num_layers={num_layers} cannot be split over {pp} pipeline stages with "
            f"num_layers_in_first_pipeline_stage={first} and num_layers_in_last_pipeline_stage={last}: the "
            f"remaining {rest} layers must divide evenly over the other {len(free)} stages"
        )
    for i in free:
        counts[i] = rest // len(free)
    return [int(c) for c in counts]  # type: ignore[arg-type]


def stage_layer_counts(
    num_layers: int,
    pp: int,
    vp: int | None = None,
    *,
    first: int | None = None,
    last: int | None = None,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
) -> list[int]:
    """Transformer layers of each virtual stage, indexed by stage (``stage = chunk × pp + pp_rank``).

    Raises ``ConfigError`` (one line) when the layers cannot be split that way.
    """
    vp = vp or 1
    if pp < 1 or vp < 1:
        raise ConfigError(f"pipeline sizes must be positive (pipeline_model_parallel_size={pp}, "
                          f"virtual_pipeline_model_parallel_size={vp})")
    num_stages = pp * vp
    if account_for_embedding or account_for_loss:
        if first is not None or last is not None:
            raise ConfigError(
                "model.account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split cannot be "
                "combined with num_layers_in_first/last_pipeline_stage: use one way of balancing the stages"
            )
        slots = num_layers + int(account_for_embedding) + int(account_for_loss)
        if slots % num_stages != 0:
            raise ConfigError(
                f"model.num_layers={num_layers} plus {slots - num_layers} (embedding/loss counted as layers) = "
                f"{slots} is not divisible by pipeline_model_parallel_size × virtual size = {num_stages}"
            )
        counts = [slots // num_stages] * num_stages
        counts[0] -= int(account_for_embedding)
        counts[-1] -= int(account_for_loss)
        return counts
    per_rank = _per_rank_layer_counts(num_layers, pp, first, last)
    for rank, count in enumerate(per_rank):
        if count % vp != 0:
            raise ConfigError(
                f"pipeline rank {rank} gets {count} layers (model.num_layers={num_layers}), not divisible by "
                f"model.virtual_pipeline_model_parallel_size={vp}"
            )
    return [per_rank[s % pp] // vp for s in range(num_stages)]


def stage_layer_numbers(counts: list[int]) -> list[list[int]]:
    """Global layer indices of each stage from its layer count (consecutive, in stage order)."""
    out, start = [], 0
    for count in counts:
        out.append(list(range(start, start + count)))
        start += count
    return out


def layer_counts_for_config(model_cfg: Any, pp: int | None = None) -> list[int]:
    """``stage_layer_counts`` for a model config (its pipeline fields)."""
    return stage_layer_counts(
        int(model_cfg.num_layers),
        int(pp if pp is not None else model_cfg.pipeline_model_parallel_size),
        getattr(model_cfg, "virtual_pipeline_model_parallel_size", None),
        first=getattr(model_cfg, "num_layers_in_first_pipeline_stage", None),
        last=getattr(model_cfg, "num_layers_in_last_pipeline_stage", None),
        account_for_embedding=bool(getattr(model_cfg, "account_for_embedding_in_pipeline_split", False)),
        account_for_loss=bool(getattr(model_cfg, "account_for_loss_in_pipeline_split", False)),
    )
