"""``longspan plan``: per-rank memory and step time of every valid layout for a config, best first.

Megatron's theoretical memory report as a search over layouts. For each (tp, pp, cp, ep) that passes
``longspan.parallel.mesh.check_layout`` and the config's own validation at that layout:

- **weights, gradients, optimizer state** per rank from the model's real parameter list (built on the meta
  device): each parameter is placed on its pipeline stage, divided by tp when the tensor-parallel plan
  splits it and by ep × etp for routed experts; bytes per parameter follow the precision (parameters in
  ``params_dtype``, float32 main copies for low-precision parameters, Adam's two float32 moments or SGD's
  momentum) and the data-parallel mode (DDP: replicated plus its gradient buckets; distributed optimizer:
  state and gradients sharded over dp with the parameters gathered from forward to backward; FSDP2: all
  sharded, one layer gathered at a time).
- **activations**: the bytes autograd saves, measured by running the model's own forward on the meta device
  at the rank's local shapes (heads, FFN and vocabulary divided by tp, sequence by cp, one microbatch) with
  a saved-tensor hook, so the recompute and fused-loss settings count as they run; dense and MoE layers
  apart, MoE routing's own tensors added (``longspan.planner.activations``); times the microbatches in
  flight on the stage (1F1B: ``min(pp - rank, microbatches)``). Full recompute keeps each recomputed
  layer's input plus one layer's (or one recompute group's) activations during backward.
- **optimizer CPU offload** (``optimizer.optimizer_cpu_offload``): the offloaded fraction of the optimizer state
  and of the step's temporaries leaves the device; ``host`` counts what it takes in host memory instead (the
  state, a float32 copy of each offloaded parameter and of its gradient).
- **buffers**: the optimizer step's temporaries (one float32 copy of the rank's optimizer-sharded
  parameters), one layer's activation gradients in backward, and the gathered FSDP2 layer.

Step time: model FLOPs (Megatron's formula, recompute adds a forward) at a fixed fraction of the device's
peak (``longspan.planner.peak_flops``), plus the routed experts' work beyond their FLOPs by
``model.moe_grouped_gemm`` (one grouped GEMM per projection, or the expert-by-expert loop's cost per local
expert: ``longspan.planner.expert_time``), stretched by the pipeline bubble of the config's schedule
(``longspan.core.pipeline_schedules.bubble_fraction``: 1F1B's (pp-1)/m, divided by the virtual stages when
interleaved, a third of it for the zero-bubble ZB1P and DualPipeV, none for ZB-V with 2 pp - 1 microbatches),
plus tensor-parallel all-reduces, context-parallel K/V gathers (all-to-alls for gated DeltaNet layers) and the
data-parallel gradient reduction at the device's link bandwidth. It is an estimate to rank layouts, not a promise; the memory figures are
checked against measured peaks in tests/perf/test_planner.py and docs/plan.md.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any, Optional

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from longspan.core.errors import ConfigError, LaunchError, NotSupportedError
from longspan.core.pipeline_schedules import PipelineSchedule, bubble_fraction, resolve_schedule, stage_rank
from longspan.models.gpt import padded_vocab_size
from longspan.models.loss import default_chunk_tokens
from longspan.parallel.data_parallel import data_parallel_mode
from longspan.parallel.mesh import Layout, check_layout, derive_layout
from longspan.parallel.pipeline import layer_counts_for_config, stage_layer_numbers
from longspan.parallel.tensor_parallel import tensor_parallel_plan
from longspan.peft.adapters import plan_adapters
from longspan.peft.nf4 import NF4_BYTES_PER_PARAM
from longspan.planner.activations import activation_parts, dtype_bytes, stage_activations
from longspan.planner.expert_time import expert_overhead_s
from longspan.planner.flops import linear_attention_flags, num_floating_point_operations
from longspan.planner.peak_flops import measured_cpu_tflops

GiB = 1024**3

#: device kind -> (peak FLOP/s of the run's dense precision, link bandwidth bytes/s, achievable fraction of peak)
#: device kind -> bytes a training process holds beyond the model (CUDA context, NCCL and cuBLAS workspaces;
#: on a CPU the libraries' and data pipeline's own allocations, measured at ~116 MiB)
RUNTIME_BYTES: dict[str, float] = {"h100": 1.0 * 2**30, "h200": 1.0 * 2**30, "a100": 1.0 * 2**30,
                                   "b200": 1.0 * 2**30, "cpu": 120.0 * 2**20}

DEVICES: dict[str, tuple[Optional[float], float, float]] = {
    "h100": (989.4e12, 450e9, 0.45),
    "h200": (989.4e12, 450e9, 0.45),
    "a100": (312e12, 300e9, 0.45),
    "b200": (2250e12, 900e9, 0.45),
    "cpu": (None, 5e9, 0.5),  # peak measured on this machine (longspan.planner.peak_flops)
}

#: parameters split over tp outside the tensor-parallel plan's module table: shared experts (by the expert-parallel
#: plan, like a dense MLP: fc1 and its gate column-wise, fc2 row-wise with its bias replicated), the MoE latent
#: projections (the same way, along the latent) and the decoder layers' attention sinks (by heads)
_SPLIT_OUTSIDE_THE_PLAN = re.compile(r"\.shared_experts\.(linear_fc1|linear_fc1_gate)\.(weight|bias)$|"
                                     r"\.shared_experts\.linear_fc2\.weight$|"
                                     r"\.mlp\.fc1_latent_proj\.(weight|bias)$|\.mlp\.fc2_latent_proj\.weight$|"
                                     r"^decoder\.layers\.\d+\.self_attention\.softmax_offset$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclasses.dataclass
class RankMemory:
    """Bytes on the busiest rank of a layout: what each kind takes at its largest, and the peak.

    The kinds are not all alive at once: the peak is the larger of two moments, the start of the loss's
    backward (activations, the loss's gradient buffers, and the gradients accumulated by earlier
    microbatches) and the optimizer step (final gradients and the step's temporaries), each on top of the
    weights, optimizer state and persistent buffers.
    """

    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    peak: float
    host: float = 0.0  # host memory of the offloaded optimizer part (not in peak: it is not on the device)

    @property
    def total(self) -> float:
        return self.peak


@dataclasses.dataclass
class PlanRow:
    """One candidate layout and its estimates."""

    layout: Layout
    dp_mode: str
    memory: RankMemory
    step_time_s: float
    tokens_per_s_per_device: float

    def fits(self, memory_per_device: float) -> bool:
        return self.memory.total <= memory_per_device


def parse_size(text: str) -> float:
    """'80GiB', '80GB', '512MiB', '1.5TiB' or a plain number of bytes -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ConfigError(f"--memory-per-device={text!r} is not a size: use e.g. 80GiB, 80GB or 512MiB")
    value, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return value * scale


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def data_parallel_mode_for(cfg: Any, layout: Layout) -> str:
    """The data-parallel wrapper a run of ``cfg`` gets at ``layout`` (see longspan.parallel.data_parallel)."""
    mode = data_parallel_mode(cfg, layout.tp)
    if layout.dp * layout.cp == 1:
        return "none"
    if mode == "ddp" and layout.tp > 1:
        return "distributed_optimizer"  # DDP does not compose with DTensors: FSDP2 without resharding
    return mode


def _layout_config(cfg: Any, layout: Layout) -> Any:
    out = copy.deepcopy(cfg)
    m = out.model
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size = layout.tp, layout.pp
    m.context_parallel_size, m.expert_model_parallel_size = layout.cp, layout.ep
    if m.num_moe_experts:
        m.expert_tensor_parallel_size = layout.etp
    if layout.tp == 1:
        m.sequence_parallel = False
    if layout.pp == 1:
        m.virtual_pipeline_model_parallel_size = m.pipeline_parallel_schedule = None
        m.num_layers_in_first_pipeline_stage = m.num_layers_in_last_pipeline_stage = None
    return out


def candidate_layouts(cfg: Any, world_size: int) -> tuple[list[tuple[Any, Layout]], list[str]]:
    """Every (config at that layout, layout) that validates for ``world_size``, and why the others do not."""
    m = cfg.model
    experts = int(m.num_moe_experts or 0)
    seq = int(m.seq_length)
    rows, rejected = [], []
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            if pp > int(m.num_layers):
                continue
            for cp in _divisors(world_size // (tp * pp)):
                if cp > 1 and seq % (2 * cp):
                    continue
                for ep in (_divisors(world_size // pp) if experts else [1]):
                    if experts and experts % ep:
                        continue
                    etp = tp  # longspan's expert parallel needs expert_tensor_parallel_size == tp
                    try:
                        layout = derive_layout(world_size, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
                        lcfg = _layout_config(cfg, layout)
                        check_layout(world_size, lcfg.model)
                        lcfg.validate(world_size=world_size)
                    except (ConfigError, LaunchError, NotSupportedError) as exc:
                        rejected.append(f"tp={tp} pp={pp} cp={cp} ep={ep}: {exc}")
                        continue
                    rows.append((lcfg, layout))
    return rows, rejected


# ----------------------------------------------------------------------------------------------- weights

def _schedule(cfg: Any, pp: int) -> PipelineSchedule:
    """The pipeline schedule the config runs at ``pp`` stages (its placement and bubble)."""
    stages_per_rank = len(layer_counts_for_config(cfg.model, pp)) // pp
    return resolve_schedule(cfg.model.pipeline_parallel_schedule, stages_per_rank)


def _last_stage_rank(cfg: Any, pp: int) -> int:
    """The pipeline rank holding the output layer: the last one, the first under a V-shaped schedule."""
    return stage_rank(len(layer_counts_for_config(cfg.model, pp)) - 1, pp, _schedule(cfg, pp).v_shape)


def _stage_of_layers(cfg: Any, pp: int) -> dict[int, int]:
    """The pipeline rank of each transformer layer."""
    counts = layer_counts_for_config(cfg.model, pp)
    v_shape = _schedule(cfg, pp).v_shape
    stage_of = {}
    for stage, numbers in enumerate(stage_layer_numbers(counts)):
        for n in numbers:
            stage_of[n] = stage_rank(stage, pp, v_shape)
    return stage_of


def tensor_parallel_split_names(meta_model: Any) -> set[str]:
    """Names of the parameters tensor parallel splits, read off the tensor-parallel plan the run applies
    (``longspan.parallel.tensor_parallel``): column-parallel weights and biases, row-parallel weights (their
    biases stay replicated), the shared experts' projections and attention sinks. Norms, routers, the MLA
    down-projections and latent norms stay whole."""
    names = set()
    for module, style in tensor_parallel_plan(meta_model).items():
        if isinstance(style, ColwiseParallel):
            names |= {f"{module}.weight", f"{module}.bias"}
        elif isinstance(style, RowwiseParallel):
            names.add(f"{module}.weight")
    names |= {n for n, _ in meta_model.named_parameters() if _SPLIT_OUTSIDE_THE_PLAN.search(n)}
    return names


def rank_parameter_counts(cfg: Any, layout: Layout, meta_model: Any) -> list[dict[str, float]]:
    """Per pipeline rank: {'dense': parameters replicated over dp, 'expert': routed-expert parameters,
    'largest_layer': parameters of its largest transformer layer, 'root': parameters outside the transformer
    layers (embedding, final norm, output layer, multi-token prediction depths: FSDP2 keeps them with the root)}
    as this rank holds them."""
    pp = layout.pp
    stage_of = _stage_of_layers(cfg, pp)
    last_rank = _last_stage_rank(cfg, pp)
    tied = bool(cfg.model.share_embeddings_and_output_weights)
    mtp = bool(cfg.model.mtp_num_layers)
    ranks = [{"dense": 0.0, "expert": 0.0, "largest_layer": 0.0, "root": 0.0, "nf4": 0.0} for _ in range(pp)]
    layer_sizes: list[dict[int, float]] = [dict() for _ in range(pp)]
    split = tensor_parallel_split_names(meta_model) if layout.tp > 1 else set()
    nf4 = nf4_weight_names(cfg, meta_model)
    for name, p in meta_model.named_parameters():
        n = float(p.numel())
        expert = ".mlp.experts." in name
        if expert:
            n /= layout.ep * layout.etp
        elif name in split:
            n /= layout.tp
        match = _LAYER.match(name)
        if name in nf4:  # frozen 4-bit base: no gradient, no optimizer state, not sharded by FSDP2
            ranks[stage_of[int(match.group(1))]]["nf4"] += n
            continue
        if match:
            stages = [stage_of[int(match.group(1))]]
            layer = int(match.group(1))
            layer_sizes[stages[0]][layer] = layer_sizes[stages[0]].get(layer, 0.0) + n
        elif name.startswith("embedding."):
            stages = [0]
            if tied and pp > 1 and "word_embeddings" in name:
                stages.append(last_rank)  # the last stage keeps its own copy of the tied output weight
            if mtp and pp > 1:
                stages.append(last_rank)  # and of the whole embedding, for the MTP depths' shifted tokens
        else:
            stages = [last_rank]
        for s in stages:
            ranks[s]["expert" if expert else "dense"] += n
            if not match:
                ranks[s]["root"] += n
    for s in range(pp):
        ranks[s]["largest_layer"] = max(layer_sizes[s].values(), default=0.0)
    return ranks


def nf4_weight_names(cfg: Any, meta_model: Any) -> set[str]:
    """The base weights QLoRA stores in NF4 (``peft.base_quantization='nf4'``): those of the adapted linear
    layers (``longspan.peft.qlora``)."""
    peft = cfg.peft
    if peft is None or peft.base_quantization != "nf4":
        return set()
    modules = dict(meta_model.named_modules())
    return {f"{name}.weight" for names in plan_adapters(meta_model, peft).values() for name in names
            if isinstance(modules[name], torch.nn.Linear)}


def model_parameter_counts(cfg: Any, meta_model: Any) -> dict[str, float]:
    """{'total': the model's parameters (tied ones once), 'active': those one token runs through, routed
    experts counted ``moe_router_topk`` of ``num_moe_experts``}, by the per-rank accounting at one rank."""
    one = rank_parameter_counts(cfg, derive_layout(1), meta_model)[0]
    experts = int(cfg.model.num_moe_experts or 0)
    share = int(cfg.model.moe_router_topk or 1) / experts if experts else 1.0
    dense = one["dense"] + one["nf4"]
    return {"total": dense + one["expert"], "active": dense + one["expert"] * share}


def summary_line(cfg: Any, meta_model: Any = None) -> str:
    """'model: N parameters (M active per token); F model FLOPs per iteration' for the plan's first line."""
    if meta_model is None:
        meta_model = _unsplit(cfg.model).provide_meta()  # the provider's own model (a family's layers)
    counts = model_parameter_counts(cfg, meta_model)
    flops = num_floating_point_operations(cfg, int(cfg.train.global_batch_size))
    return (f"model: {counts['total']:,.0f} parameters ({counts['active']:,.0f} active per token); "
            f"{flops:.3e} model FLOPs per iteration")


# ----------------------------------------------------------------------------------------------- memory

def _output_transient(cfg: Any, layout: Layout) -> float:
    """Bytes alive only during the loss's backward: the float32 logits' gradient and the log-softmax gradient
    (the plain loss), the reused logits buffer (the float32 fused loss), or the recomputed chunk and its
    gradient (the chunked loss)."""
    vocab = padded_vocab_size(cfg.model) // layout.tp
    tokens = int(cfg.train.micro_batch_size) * int(cfg.model.seq_length) // layout.cp
    if cfg.model.cross_entropy_loss_fusion:
        return 2.0 * min(tokens, default_chunk_tokens(vocab)) * vocab * 4
    if layout.tp == 1 and dtype_bytes(cfg.model.params_dtype) == 4 and not (
        cfg.model.fp16_lm_cross_entropy or cfg.model.enable_autocast
    ):
        # fused_linear_cross_entropy: the logits' gradient is formed in the forward (and saved, counted with
        # the activations); the logits buffer it was computed from stays in the model's LogitsWorkspace
        return 1.0 * tokens * vocab * 4
    # torch's loss_parallel (tp > 1) also keeps the shifted logits and their exponentials of the shard
    return (4.0 if layout.tp > 1 else 2.0) * tokens * vocab * 4


def estimate_memory(cfg: Any, layout: Layout, meta_model: Any = None,
                    parts: Optional[dict[str, float]] = None, device: str = "cpu") -> RankMemory:
    """Memory of the busiest rank of ``cfg`` at ``layout`` (see the module docstring and ``RankMemory``)."""
    if meta_model is None:
        meta_model = _unsplit(cfg.model).provide_meta()  # the provider's own model (a family's layers)
    parts = parts or activation_parts(cfg, layout)
    mode = data_parallel_mode_for(cfg, layout)
    dp = layout.dp * layout.cp  # gradients are reduced (and FSDP2 shards) over dp x cp
    edp = max(1, layout.edp)
    m = cfg.model
    pb = dtype_bytes(m.params_dtype)
    main_bytes = 0 if pb == 4 else 4
    optimizer = str(cfg.optimizer.optimizer).lower()
    # Muon counts as AdamW: an upper bound (its matrices keep one fp32 momentum, the rest AdamW's two moments).
    state_bytes = 8 if optimizer in ("adam", "muon") else (4 if float(cfg.optimizer.sgd_momentum or 0) else 0)
    if cfg.optimizer.use_precision_aware_optimizer:  # main params and moments in their dtypes
        main_bytes = 0 if pb == 4 else dtype_bytes(cfg.optimizer.main_params_dtype)
        state_bytes = dtype_bytes(cfg.optimizer.exp_avg_dtype) + dtype_bytes(cfg.optimizer.exp_avg_sq_dtype)
    offloaded = float(cfg.optimizer.optimizer_offload_fraction) if cfg.optimizer.optimizer_cpu_offload else 0.0
    gbs, mbs = int(cfg.train.global_batch_size), int(cfg.train.micro_batch_size)
    microbatches = max(1, gbs // (mbs * layout.dp))
    stage_of = _stage_of_layers(cfg, layout.pp)
    runtime = RUNTIME_BYTES.get(device, RUNTIME_BYTES["h100"])
    best: Optional[RankMemory] = None
    for rank, counts in enumerate(rank_parameter_counts(cfg, layout, meta_model)):
        local = counts["dense"] + counts["expert"]
        if mode in ("none", "ddp"):
            shard = held = final_grads = local
            early_grads = 0.0
            persistent = local * pb if mode == "ddp" else 0.0  # DDP's gradient buckets
        else:
            shard = counts["dense"] / dp + counts["expert"] / edp
            if mode == "fsdp2":  # the root (embedding, final norm, output layer) stays gathered; one layer more
                held = shard + counts["root"] + counts["largest_layer"]
                persistent = counts["largest_layer"] * pb  # the next layer's all-gather (prefetch)
            else:  # distributed optimizer: FSDP2 without resharding, parameters gathered forward to backward
                held = shard + local
                persistent = 0.0
            final_grads = shard
            early_grads = counts["root"]  # the root's unsharded gradients live until the end of backward
        accumulated = (local if mode in ("none", "ddp") else local + shard) if microbatches > 1 else early_grads
        weights = held * pb + shard * main_bytes + counts["nf4"] * NF4_BYTES_PER_PARAM
        opt = shard * state_bytes * (1.0 - offloaded)
        host = shard * offloaded * (state_bytes + 4 + 4)  # state, float32 parameter and gradient copies
        layers = [n for n, s in stage_of.items() if s == rank]
        in_flight = min(layout.pp - rank, microbatches) if layout.pp > 1 else 1
        per_mb = stage_activations(cfg, parts, layers)
        if rank == 0:
            per_mb += parts["embedding"]
        last = rank == _last_stage_rank(cfg, layout.pp)
        if last:
            per_mb += parts["output"]
        activations = in_flight * per_mb
        backward = parts["layer"] + (_output_transient(cfg, layout) if last else 0.0)
        step = shard * 4 * (1.0 - offloaded)  # the optimizer step's float32 temporaries on the device
        base = weights + opt + persistent + runtime
        peak = max(base + activations + backward + accumulated * pb, base + final_grads * pb + step)
        mem = RankMemory(weights, max(accumulated, final_grads) * pb, opt, activations,
                         persistent + runtime + max(backward, step), peak, host)
        if best is None or mem.peak > best.peak:
            best = mem
    assert best is not None
    return best


def _unsplit(model_cfg: Any) -> Any:
    m = copy.deepcopy(model_cfg)
    m.tensor_model_parallel_size = m.pipeline_model_parallel_size = m.context_parallel_size = 1
    m.expert_model_parallel_size = 1
    m.sequence_parallel = False
    return m


# ----------------------------------------------------------------------------------------------- time

def estimate_step_time(cfg: Any, layout: Layout, device: str, meta_model: Any = None) -> float:
    """Seconds per iteration (see the module docstring)."""

    peak, bandwidth, efficiency = DEVICES[device]
    if peak is None:
        peak = measured_cpu_tflops(torch.get_num_threads()) * 1e12
    m = cfg.model
    gbs, mbs = int(cfg.train.global_batch_size), int(cfg.train.micro_batch_size)
    flops = num_floating_point_operations(cfg, gbs)
    if m.recompute_granularity == "full":
        flops *= 4.0 / 3.0
    compute = flops / layout.world_size / (peak * efficiency)
    microbatches = max(1, gbs // (mbs * layout.dp))
    compute += expert_overhead_s(cfg, device, layout.ep, microbatches, _stage_of_layers(cfg, layout.pp))
    vp = int(m.virtual_pipeline_model_parallel_size or 1)
    compute *= 1.0 + bubble_fraction(_schedule(cfg, layout.pp), layout.pp, microbatches, vp)
    seq = int(m.seq_length) // layout.cp
    act_bytes = dtype_bytes(m.params_dtype)
    layers_per_stage = -(-int(m.num_layers) // layout.pp)
    comm = 0.0
    if layout.tp > 1:  # 2 all-reduces forward + 2 backward per layer and microbatch
        size = mbs * seq * m.hidden_size * act_bytes
        comm += 4 * layers_per_stage * microbatches * 2 * (layout.tp - 1) / layout.tp * size / bandwidth
    if layout.cp > 1:
        comm += _context_parallel_bytes(m, layout, mbs, seq, layers_per_stage, microbatches) * act_bytes / bandwidth
    dp = layout.dp * layout.cp
    if dp > 1:
        if meta_model is None:
                    meta_model = _unsplit(m).provide_meta()
        params = max(r["dense"] + r["expert"] for r in rank_parameter_counts(cfg, layout, meta_model))
        comm += 2 * (dp - 1) / dp * params * 4 / bandwidth
    return compute + comm


def _context_parallel_bytes(m: Any, layout: Layout, mbs: int, seq: int, layers_per_stage: int,
                            microbatches: int) -> float:
    """Elements context parallel moves per iteration on a stage: an attention layer all-gathers K/V forward and
    reduce-scatters their gradients backward; a gated DeltaNet layer exchanges its q/k/v in and its output back
    all-to-all (sequence chunks <-> heads), forward and backward."""
    linear = linear_attention_flags(m, int(m.num_layers))
    linear_share = sum(linear) / len(linear)
    heads = int(m.num_attention_heads)
    kv = 2 * mbs * seq * int(m.num_query_groups or heads) // layout.tp * (m.kv_channels or m.hidden_size // heads)
    out = 2 * layers_per_stage * (1 - linear_share) * microbatches * (layout.cp - 1) * kv
    if linear_share:
        key = int(m.linear_num_key_heads) * int(m.linear_key_head_dim)
        value = int(m.linear_num_value_heads) * int(m.linear_value_head_dim)
        exchanged = mbs * seq * (2 * key + 2 * value) // layout.tp * (layout.cp - 1) / layout.cp
        out += 2 * layers_per_stage * linear_share * microbatches * exchanged
    return out


# ----------------------------------------------------------------------------------------------- search

def plan(cfg: Any, world_size: int, device: str) -> tuple[list[PlanRow], list[str]]:
    """Every valid layout with its estimates, fastest first; and the rejected layouts with reasons."""
    if device not in DEVICES:
        raise ConfigError(f"--device={device!r} is not one of {', '.join(DEVICES)}")
    cfg.model.finalize()
    meta_model = _unsplit(cfg.model).provide_meta()  # the provider's own model (a family's layers)
    candidates, rejected = candidate_layouts(cfg, world_size)
    rows = []
    tokens = int(cfg.train.global_batch_size) * int(cfg.model.seq_length)
    for lcfg, layout in candidates:
        memory = estimate_memory(lcfg, layout, meta_model, device=device)
        step = estimate_step_time(lcfg, layout, device, meta_model)
        rows.append(PlanRow(layout, data_parallel_mode_for(lcfg, layout), memory, step,
                            tokens / step / world_size))
    rows.sort(key=lambda r: (r.step_time_s, r.memory.total))
    return rows, rejected


def format_table(rows: list[PlanRow], memory_per_device: float) -> str:
    """The plan as a fixed-width table (GiB per rank), fitting layouts first, each group fastest first."""
    header = (f"{'tp':>3} {'pp':>3} {'cp':>3} {'dp':>3} {'ep':>3} {'dp mode':<22} {'weights':>8} {'grads':>8} "
              f"{'optim':>8} {'activ':>8} {'buffers':>8} {'peak':>8} {'fits':>4} {'step s':>9} {'tok/s/dev':>10}")
    memory_unit = f"{'GiB':>8} " * 6
    units = f"{'':>3} {'':>3} {'':>3} {'':>3} {'':>3} {'(per rank)':<22} {memory_unit}{'':>4} {'seconds':>9} {'tokens/s':>10}"
    lines = [header, units.rstrip(), "-" * len(header)]
    ordered = [r for r in rows if r.fits(memory_per_device)] + [r for r in rows if not r.fits(memory_per_device)]
    for r in ordered:
        L, M = r.layout, r.memory
        lines.append(
            f"{L.tp:>3} {L.pp:>3} {L.cp:>3} {L.dp:>3} {L.ep:>3} {r.dp_mode:<22} {M.weights / GiB:>8.3f} "
            f"{M.grads / GiB:>8.3f} {M.optimizer / GiB:>8.3f} {M.activations / GiB:>8.3f} {M.buffers / GiB:>8.3f} "
            f"{M.total / GiB:>8.3f} {'yes' if r.fits(memory_per_device) else 'no':>4} {r.step_time_s:>9.4g} "
            f"{r.tokens_per_s_per_device:>10.4g}"
        )
    host = max((r.memory.host for r in rows), default=0.0)
    if host:
        lines.append(f"optimizer CPU offload: up to {host / GiB:.3f} GiB of host memory per rank (not in the columns)")
    return "\n".join(lines)
