"""How a model's transformer layers split over pipeline stages: Megatron's layout arithmetic, no torch.

Layout (Megatron's): the layers are split over ``pp × vp`` virtual stages; virtual stage ``s`` lives on pipeline
rank ``s % pp`` as its model chunk ``s // pp``. ``num_layers_in_first_pipeline_stage`` /
``num_layers_in_last_pipeline_stage`` fix the first / last pipeline rank's layer counts and the other ranks share
the rest evenly; ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split`` count the
embedding / loss as one layer of the first / last stage. It is arithmetic over the model's shape and its
pipeline fields, kept in core so that both sides read the one split: ``ConfigContainer.validate()``
(``longspan.config.rules.layout``) rejects a split with it and ``longspan.parallel.pipeline`` cuts the model
with it. ``model_cfg`` below is any model provider (a TransformerConfig: these fields are all its own).
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
    """``stage_layer_counts`` for a model config (its pipeline fields). A T5 model's layers are its encoder
    layers followed by its decoder layers (see ``t5_layer_counts``)."""
    pp = int(pp if pp is not None else model_cfg.pipeline_model_parallel_size)
    num_layers = int(model_cfg.num_layers)
    if hasattr(model_cfg, "encoder_num_layers") and hasattr(model_cfg, "seq_length_dec"):
        encoder_layers = model_cfg.encoder_num_layers if model_cfg.encoder_num_layers is not None else num_layers
        encoder_stages = int(model_cfg.encoder_pipeline_model_parallel_size or 0)
        if encoder_stages:
            return t5_layer_counts(int(encoder_layers), num_layers, pp, encoder_stages, model_cfg)
        try:
            return _counts(model_cfg, num_layers + int(encoder_layers), pp)
        except ConfigError as error:
            raise ConfigError(f"{error} (T5: model.encoder_num_layers={encoder_layers} + model.num_layers="
                              f"{num_layers} layers)") from None
    return _counts(model_cfg, num_layers, pp)


def _counts(model_cfg: Any, num_layers: int, pp: int) -> list[int]:
    return stage_layer_counts(
        num_layers,
        pp,
        model_cfg.virtual_pipeline_model_parallel_size,
        first=model_cfg.num_layers_in_first_pipeline_stage,
        last=model_cfg.num_layers_in_last_pipeline_stage,
        account_for_embedding=bool(model_cfg.account_for_embedding_in_pipeline_split),
        account_for_loss=bool(model_cfg.account_for_loss_in_pipeline_split),
    )


#: the pipeline fields that shape an even split themselves (not combinable with separate encoder stages)
_SPLIT_FIELDS = ("virtual_pipeline_model_parallel_size", "num_layers_in_first_pipeline_stage",
                 "num_layers_in_last_pipeline_stage", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split")


def t5_layer_counts(encoder_layers: int, decoder_layers: int, pp: int, encoder_stages: int, model_cfg: Any) -> list[int]:
    """T5 with ``encoder_pipeline_model_parallel_size = encoder_stages`` > 0: the encoder layers split evenly
    over the first ``encoder_stages`` pipeline stages, the decoder layers over the others."""
    if not 0 < encoder_stages < pp:
        raise ConfigError(
            f"model.encoder_pipeline_model_parallel_size={encoder_stages} must be 0 or less than "
            f"model.pipeline_model_parallel_size={pp} (the decoder needs a stage of its own)"
        )
    for name in _SPLIT_FIELDS:
        if getattr(model_cfg, name):
            raise ConfigError(
                f"model.{name}={getattr(model_cfg, name)!r} cannot be combined with "
                f"model.encoder_pipeline_model_parallel_size={encoder_stages}: leave one of them unset"
            )
    decoder_stages = pp - encoder_stages
    if encoder_layers % encoder_stages or decoder_layers % decoder_stages:
        raise ConfigError(
            f"model.encoder_num_layers={encoder_layers} must divide evenly over "
            f"encoder_pipeline_model_parallel_size={encoder_stages} stages and model.num_layers={decoder_layers} "
            f"over the other {decoder_stages}"
        )
    return [encoder_layers // encoder_stages] * encoder_stages + [decoder_layers // decoder_stages] * decoder_stages
