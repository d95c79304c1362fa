"""Parallel-layout rules of ``ConfigContainer.validate()``: sizes against the world size, heads, layers and
vocabulary against tensor/pipeline parallel, context- and expert-parallel options, the pipeline schedule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from longspan.config.rules.ranges import positive_int
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.core.pipeline_schedules import resolve_schedule
from longspan.core.pipeline_split import layer_counts_for_config
from longspan.core.vocab import calculate_padded_vocab_size

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer


def check_parallel_layout(cfg: "ConfigContainer", ws: int) -> int:
    """Check the model's parallel sizes against ``ws`` ranks and the model's shapes; return the data-parallel size."""
    m = cfg.model
    dp = _check_sizes_against_world(m, ws)
    _check_layer_split(m)
    _check_shapes_against_parallel_sizes(m)
    check_context_parallel_options(m)
    check_sequence_scatter(m)
    return dp


def _check_sizes_against_world(m: object, ws: int) -> int:
    """tp x pp x cp and the expert grid must tile ``ws`` ranks; return the data-parallel size."""
    tp = positive_int(m.tensor_model_parallel_size, "model.tensor_model_parallel_size")
    pp = positive_int(m.pipeline_model_parallel_size, "model.pipeline_model_parallel_size")
    cp = positive_int(m.context_parallel_size, "model.context_parallel_size")
    ep = positive_int(m.expert_model_parallel_size, "model.expert_model_parallel_size")
    mp = tp * pp * cp
    if ws % mp != 0:
        raise ConfigError(
            f"world size {ws} is not divisible by model.tensor_model_parallel_size ({tp}) x "
            f"model.pipeline_model_parallel_size ({pp}) x model.context_parallel_size ({cp}) = {mp}"
        )
    dp = ws // mp
    etp = m.expert_tensor_parallel_size or tp
    if (ep > 1 or etp != tp) and ws % (etp * ep * pp) != 0:
        raise ConfigError(
            f"world size {ws} is not divisible by model.expert_tensor_parallel_size ({etp}) x "
            f"model.expert_model_parallel_size ({ep}) x model.pipeline_model_parallel_size ({pp})"
        )
    if ep > 1:
        experts = m.num_moe_experts
        if not experts:
            raise ConfigError(f"model.expert_model_parallel_size={ep} needs model.num_moe_experts to be set")
        if experts % ep != 0:
            raise ConfigError(
                f"model.num_moe_experts={experts} is not divisible by model.expert_model_parallel_size={ep}"
            )
    if m.sequence_parallel and tp == 1:
        raise ConfigError("model.sequence_parallel=True needs model.tensor_model_parallel_size > 1 (it is 1)")
    return dp


def check_sequence_scatter(m: object) -> None:
    """Where sequence parallel cuts the embedded sequence (``scatter_embedding_sequence_parallel``) against what
    the model does with the whole sequence first (see :func:`sequence_scatter_error`)."""
    if not m.sequence_parallel or (m.tensor_model_parallel_size or 1) == 1:
        return
    # getattr: GPTModelProvider's field (its default True); T5 and Mamba providers do not declare it
    scatter = getattr(m, "scatter_embedding_sequence_parallel", True)
    error = sequence_scatter_error(type(m).__name__, scatter, m.mtp_num_layers,
                                   hasattr(m, "vision_config") and hasattr(m, "image_token_id"))
    if error is not None:
        raise error


def sequence_scatter_error(model_name: str, scatter: bool, mtp_num_layers: int | None,
                           puts_images_in_sequence: bool) -> Exception | None:
    """The one-line error of a sequence-parallel model whose ``scatter_embedding_sequence_parallel`` does not
    fit it, or None: a vision-language model puts its image embeddings into the whole sequence (the cut must
    come after: False); multi-token prediction embeds on sequence shards (True). The parallel plan asks too."""
    if scatter and puts_images_in_sequence:
        return ConfigError(
            f"model.scatter_embedding_sequence_parallel=True with model.sequence_parallel=True: {model_name} puts "
            "its image embeddings into the whole sequence before the sequence-parallel split; set it False"
        )
    if not scatter and mtp_num_layers:
        return NotSupportedError(
            f"model.scatter_embedding_sequence_parallel=False with model.sequence_parallel=True and "
            f"model.mtp_num_layers={mtp_num_layers} is not supported yet: the multi-token prediction depths embed "
            "on sequence shards; set it True"
        )
    return None


def _check_layer_split(m: object) -> None:
    """The layers divide evenly over pipeline (and virtual pipeline) stages unless the split is uneven."""
    pp = m.pipeline_model_parallel_size
    layers = positive_int(m.num_layers, "model.num_layers")
    vp = m.virtual_pipeline_model_parallel_size
    uneven = m.num_layers_in_first_pipeline_stage is not None or m.num_layers_in_last_pipeline_stage is not None
    uneven = uneven or m.account_for_embedding_in_pipeline_split or m.account_for_loss_in_pipeline_split
    if vp is not None and pp == 1:
        raise ConfigError(
            f"model.virtual_pipeline_model_parallel_size={vp} needs model.pipeline_model_parallel_size > 1"
        )
    if hasattr(m, "seq_length_dec"):  # T5: encoder + decoder layers, split by layer_counts_for_config below
        return
    if vp is not None:
        if not uneven and layers % (pp * vp) != 0:
            raise ConfigError(
                f"model.num_layers={layers} is not divisible by model.pipeline_model_parallel_size ({pp}) x "
                f"model.virtual_pipeline_model_parallel_size ({vp})"
            )
    if not uneven and layers % pp != 0:
        raise ConfigError(
            f"model.num_layers={layers} is not divisible by model.pipeline_model_parallel_size={pp}"
        )


def _check_shapes_against_parallel_sizes(m: object) -> None:
    """Heads, query groups, FFN width and the padded vocabulary split over tp; the sequence over 2 x cp."""
    tp, cp = m.tensor_model_parallel_size, m.context_parallel_size
    heads = positive_int(m.num_attention_heads, "model.num_attention_heads")
    hidden = positive_int(m.hidden_size, "model.hidden_size")
    groups = m.num_query_groups or heads
    if heads % groups != 0:
        raise ConfigError(f"model.num_attention_heads={heads} is not divisible by model.num_query_groups={groups}")
    check_tp_divides_heads(tp, heads, groups)
    if m.kv_channels is None and hidden % heads != 0:
        raise ConfigError(
            f"model.hidden_size={hidden} is not divisible by model.num_attention_heads={heads}: "
            "set model.kv_channels"
        )
    padded = None
    if m.vocab_size is not None:
        padded = calculate_padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    check_tp_divides_widths(tp, m.ffn_hidden_size, padded, vocab_size=m.vocab_size,
                            make_vocab_size_divisible_by=m.make_vocab_size_divisible_by)
    if cp > 1 and m.seq_length % (2 * cp) != 0:
        raise ConfigError(
            f"model.seq_length={m.seq_length} is not divisible by 2 x model.context_parallel_size ({2 * cp})"
        )
    # tp alone: the model rules (linear_attention.py); getattr: GPTModelProvider's fields
    if cp > 1 and getattr(m, "experimental_attention_variant", None) is not None:
        check_linear_attention_heads_split(m.linear_num_key_heads, m.linear_num_value_heads, tp, cp)
    decoder_length = getattr(m, "seq_length_dec", None)  # getattr: T5's field; its decoder sequence splits alike
    if cp > 1 and decoder_length is not None and decoder_length % (2 * cp) != 0:
        raise ConfigError(
            f"model.seq_length_dec={decoder_length} is not divisible by 2 x model.context_parallel_size ({2 * cp})"
        )


def check_tp_divides_heads(tp: int, heads: int, groups: int) -> None:
    """Tensor parallel splits attention by heads: ``tp`` must divide the query heads and the key/value groups
    (``groups``: ``num_query_groups``, or ``heads`` when that is None). The config's validation, the launcher's
    layout check and the tensor-parallel plans all ask this one rule."""
    if heads % tp != 0 or groups % tp != 0:
        raise ConfigError(
            f"model.tensor_model_parallel_size={tp} must divide model.num_attention_heads={heads} and "
            f"model.num_query_groups={groups}; use a tensor_model_parallel_size that divides both"
        )


def check_linear_attention_heads_split(key_heads: int, value_heads: int, tp: int, cp: int) -> None:
    """Gated DeltaNet layers are split by heads: over tensor parallel, and further over context parallel, whose
    all-to-all gives each rank the whole sequence (packed documents included) of a share of the heads. So
    ``tp · cp`` must divide the key and the value heads. The config's validation and the parallel plans ask this
    one rule."""
    ways = tp * cp
    if key_heads % ways or value_heads % ways:
        raise ConfigError(
            f"model.tensor_model_parallel_size={tp} × model.context_parallel_size={cp} must divide "
            f"model.linear_num_key_heads={key_heads} and model.linear_num_value_heads={value_heads}: gated "
            "DeltaNet layers are split by heads (context parallel exchanges whole sequences of a share of them)"
        )


def check_tp_divides_widths(tp: int, ffn_hidden_size: int | None, padded_vocab_size: int | None, *,
                            vocab_size: int | None = None, make_vocab_size_divisible_by: int | None = None) -> None:
    """Tensor parallel splits the MLP by ``ffn_hidden_size`` and the embedding and output layer by the padded
    vocabulary (None: not checked). ``vocab_size`` / ``make_vocab_size_divisible_by``, when given, say in the
    error where the padded size comes from."""
    if ffn_hidden_size is not None and ffn_hidden_size % tp != 0:
        raise ConfigError(
            f"model.ffn_hidden_size={ffn_hidden_size} is not divisible by model.tensor_model_parallel_size={tp}"
        )
    if padded_vocab_size is not None and padded_vocab_size % tp != 0:
        origin = ""
        if vocab_size is not None:
            origin = (f" (model.vocab_size={vocab_size} rounded up to "
                      f"model.make_vocab_size_divisible_by={make_vocab_size_divisible_by})")
        raise ConfigError(
            f"padded vocabulary {padded_vocab_size}{origin} is not divisible by "
            f"model.tensor_model_parallel_size={tp}: use a make_vocab_size_divisible_by that tp divides"
        )


#: Megatron's cp_comm_type values; longspan computes the same exact attention for each (all-gather of K/V over one
#: flat group), so they and the a2a+p2p sub-group sizes change only Megatron's communication schedule
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def check_context_parallel_options(m: object) -> None:
    """``cp_comm_type`` one of CP_COMM_TYPES (or one per layer); ``hierarchical_context_parallel_sizes`` as
    megatron-core builds its groups: positive sizes whose product is context_parallel_size, and (since only the
    a2a+p2p attention reads them) set exactly when a layer uses 'a2a+p2p'."""
    comm = m.cp_comm_type
    values = list(comm) if isinstance(comm, (list, tuple)) else [comm]
    for value in values:
        if value is not None and value not in CP_COMM_TYPES:
            raise ConfigError(
                f"model.cp_comm_type={comm!r} is not valid: use None or one of {', '.join(CP_COMM_TYPES)} "
                "(per layer as a list)"
            )
    cp = m.context_parallel_size
    hierarchical = m.hierarchical_context_parallel_sizes
    uses_a2a_p2p = "a2a+p2p" in values
    if hierarchical is None:
        if uses_a2a_p2p and cp > 1:
            raise ConfigError(
                f"model.cp_comm_type={comm!r} needs model.hierarchical_context_parallel_sizes (the a2a and p2p "
                f"group sizes, whose product is model.context_parallel_size={cp})"
            )
        return
    sizes = list(hierarchical) if isinstance(hierarchical, (list, tuple)) else None
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ConfigError(
            f"model.hierarchical_context_parallel_sizes={hierarchical!r} must be a list of positive integers")
    product = 1
    for n in sizes:
        product *= n
    if product != cp:
        raise ConfigError(
            f"model.hierarchical_context_parallel_sizes={sizes!r} multiply to {product}, but "
            f"model.context_parallel_size={cp}: their product must equal it")
    if not uses_a2a_p2p:
        raise ConfigError(
            f"model.hierarchical_context_parallel_sizes={sizes!r} is read only by cp_comm_type='a2a+p2p' "
            f"(model.cp_comm_type={comm!r}): set that or unset the sizes")


#: megatron-core's pipeline group backends (None: the default process group's)
PIPELINE_COMM_BACKENDS = (None, "nccl", "ucc")


def check_pipeline(cfg: "ConfigContainer", num_microbatches: int) -> None:
    """Pipeline rules: the layer split, enough microbatches for the schedule, the p2p knobs."""
    m = cfg.model
    pp = m.pipeline_model_parallel_size
    backend = m.pipeline_model_parallel_comm_backend
    if backend not in PIPELINE_COMM_BACKENDS:
        raise ConfigError(
            f"model.pipeline_model_parallel_comm_backend={backend!r} is not valid: use None (the default process "
            "group's backend), 'nccl' or 'ucc'")
    if m.overlap_p2p_comm and m.batch_p2p_comm:
        raise ConfigError("model.overlap_p2p_comm=True needs model.batch_p2p_comm=False (Megatron's rule): set one")
    if m.overlap_p2p_comm_warmup_flush and (not m.overlap_p2p_comm or m.batch_p2p_comm):
        raise ConfigError(
            "model.overlap_p2p_comm_warmup_flush=True needs model.overlap_p2p_comm=True and model.batch_p2p_comm=False"
        )
    if pp == 1:
        return
    layer_counts_for_config(m, pp)  # uneven and embedding/loss-aware splits: one line naming the fields
    if num_microbatches < pp:
        raise ConfigError(
            f"{num_microbatches} microbatches (train.global_batch_size={cfg.train.global_batch_size} / "
            f"(micro_batch_size {cfg.train.micro_batch_size} x data-parallel size)) is fewer than "
            f"model.pipeline_model_parallel_size={pp} stages: the pipeline needs at least one microbatch per stage"
        )
    group = m.microbatch_group_size_per_vp_stage
    # the V-shaped schedules run any microbatch count (longspan.config.rules.pipeline_schedule checks theirs)
    v_shape = m.pipeline_parallel_schedule is not None and resolve_schedule(m.pipeline_parallel_schedule).v_shape
    if m.virtual_pipeline_model_parallel_size is not None:
        if group is not None and group != pp:
            raise NotSupportedError(
                f"model.microbatch_group_size_per_vp_stage={group} is not supported: torch's interleaved 1F1B "
                f"runs groups of pipeline_model_parallel_size ({pp}) microbatches per virtual stage; leave it None"
            )
        if num_microbatches % pp != 0 and not v_shape:
            raise ConfigError(
                f"{num_microbatches} microbatches is not a multiple of model.pipeline_model_parallel_size={pp}, "
                "which the interleaved schedule (virtual_pipeline_model_parallel_size) needs"
            )
