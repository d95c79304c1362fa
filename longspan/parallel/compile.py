"""The compiled fast path: ``torch.compile`` per transformer layer, applied from outside after the parallel plans.

``compile_model(chunks, setting, device, tensor_parallel)`` replaces each transformer layer's ``forward`` with
a compiled one (torchtitan's per-block compile). It runs after tensor/sequence/context/expert/data parallelism
and pipeline splitting, so every layout gets it the same way: the module tree, parameter names and the
wrappers' hooks (FSDP2's all-gathers, DDP's reducer) stay as they were. The TP plans' hooks on the layer's sub-modules
(linear_q, linear_proj, the SP norms, ...) are traced into the layer's graph with their DTensor
redistributions. Full activation recompute wraps compiled layers (``torch.utils.checkpoint`` recomputes
through them). Two pieces stay eager inside a compiled layer (graph breaks around them):

- an MoE layer's token dispatch and experts (data-dependent token counts; expert parallel's all-to-all);
- with selective recompute, the checkpointed attention core (traced, it fails under tensor parallel).

Under tensor parallel, a layer with one of these (or with context parallel's attention, which breaks the
graph itself) compiles its other sub-blocks whole instead of the layer: see ``_compile_layer``.

Tested (compiled vs eager losses, fp32 CPU, dropout on, rel <= 1e-5 over 20 iterations; tests/perf/
test_compile.py and test_compile_layouts.py): one process, DDP2, FSDP2 DP2, TP2 with full recompute, TP2 + SP
with selective recompute, PP2, CP2, MoE under EP2; bit-exact resume compiled in one process and TP2 + SP.
Model level (every parameter's gradient, rel 1e-5): TP2 + SP with selective recompute, MoE under TP2. Also
run by hand (same losses or gradients): DP2 x TP2 (FSDP2 over TP), CP2 x TP2 + SP and MoE EP2 x TP2 (4 ranks
each), TP2 + SP with the chunked loss, MoE over DP2 without expert parallel, hybrid Mamba in one process.
Not tried: T5 (the decoder stack's layers would compile the same way; the encoder's are not compiled).

Randomness: inductor is told to draw random numbers with eager's generator (``fallback_random``), so dropout
masks, losses and resumed runs are the same with and without compile.

Which runs compile (``train.torch_compile``): True always, False never, None (the default) where it pays:
on CUDA, and on a CPU only when ``CPU_DEFAULT`` says so (decided from benchmarks/bench_train_step.py on this
project's CPU machine; see docs/performance.md). When the platform cannot compile (no C++ compiler for
inductor's CPU code, no Triton for CUDA, a Python dynamo does not support), one line says so and training
runs eager.
"""

from __future__ import annotations

import shutil
import time
from typing import Any, Optional

import torch
from torch import nn

from longspan.core.logging import get_logger, print_rank_0, warn_rank_0
from longspan.models.attention import core_attention
from longspan.models.gpt_provider import TransformerConfig

_log = get_logger(__name__)

#: whether ``train.torch_compile=None`` compiles on a CPU (see the module docstring)
CPU_DEFAULT = False


def compile_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why this platform cannot run inductor-compiled code on ``device``, or None when it can."""
    try:
        # start-up time: dynamo and inductor load only when train.torch_compile is on
        from torch._dynamo.eval_frame import is_dynamo_supported

        if not is_dynamo_supported():
            return "torch.compile does not support this Python"
    except ImportError:
        return "this torch has no torch._dynamo"
    if device.type == "cuda":
        try:
            # start-up time: dynamo and inductor load only when train.torch_compile is on
            from torch.utils._triton import has_triton
        except ImportError:
            return "this torch cannot tell whether Triton is installed"
        return None if has_triton() else "Triton is not installed"
    if device.type == "cpu":
        if not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
            return "no C++ compiler (g++, c++ or clang++) on PATH"
        return None
    return f"device type {device.type!r} is not handled by longspan's compile plan"


def cuda_graph_warmup(model_config: TransformerConfig, device: torch.device) -> Optional[int]:
    """The warmup forwards before CUDA-graph capture when the model asks for CUDA graphs (model.enable_cuda_graph,
    or external_cuda_graph: Transformer Engine's capture of the same layers) and runs on CUDA; None otherwise
    (elsewhere start-up lists the fields as not applicable)."""
    wanted = model_config.enable_cuda_graph or model_config.external_cuda_graph
    if not wanted or device.type != "cuda":
        return None
    return int(model_config.cuda_graph_warmup_steps)


def mark_cuda_graph_step() -> None:
    """Tell Inductor's CUDA-graph trees a training iteration begins (outputs of the previous one may be reused)."""
    torch.compiler.cudagraph_mark_step_begin()


def compile_enabled(setting: Optional[bool], device: torch.device) -> bool:
    """``train.torch_compile`` resolved for ``device`` (None: on for CUDA, ``CPU_DEFAULT`` on a CPU)."""
    if setting is not None:
        return bool(setting)
    return device.type == "cuda" or (device.type == "cpu" and CPU_DEFAULT)


def _plain(chunk: nn.Module) -> nn.Module:
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module  # DDP and similar wrappers
    return chunk


def transformer_layers(chunks: list[nn.Module]) -> list[nn.Module]:
    """The transformer layers of every model chunk (those a per-block compile wraps)."""
    layers: list[nn.Module] = []
    for chunk in chunks:
        decoder = getattr(_plain(chunk), "decoder", None)
        if decoder is not None:
            layers.extend(decoder.layers.values())
    return layers


def compile_model(chunks: list[nn.Module], setting: Optional[bool], device: torch.device,
                  tensor_parallel: int = 1, cuda_graph_warmup: Optional[int] = None) -> bool:
    """Compile each transformer layer's forward in place when ``setting`` resolves on; return whether it did.

    Call after every parallel plan (TP/SP, CP, EP, FSDP2/DDP, pipeline split). An MoE layer's token dispatch
    and a checkpointed attention core (selective recompute) stay eager, and context parallel's attention has
    graph breaks of its own: without tensor parallel these are graph breaks inside the compiled layer; under
    tensor parallel (``tensor_parallel`` > 1) a layer with such a part compiles only its other sub-blocks
    (attention, dense MLP) whole, because a graph break inside a tensor-parallel layer gives wrong gradients or
    fails in backward (see ``_compile_layer``). Returns False (and says so) when no layer had anything left
    to compile.

    ``cuda_graph_warmup`` (model.enable_cuda_graph on CUDA; None: off): the layers compile with
    ``mode="reduce-overhead"``, whose CUDA-graph trees capture each compiled layer's forward and backward, and
    each layer's first ``cuda_graph_warmup`` training forwards run eager first (Megatron's warmup runs before
    capture). See ``cuda_graph_warmup_forwards``."""
    if not compile_enabled(setting, device):
        return False
    reason = compile_unavailable_reason(device)
    if reason is not None:
        warn_rank_0(f"train.torch_compile: {reason}; training runs eager (set train.torch_compile=False to "
                    "silence this)")
        return False
    # start-up time: dynamo and inductor load only when train.torch_compile is on
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config  # (same reason)

    inductor_config.fallback_random = True  # eager's RNG: same dropout masks with and without compile
    layers = transformer_layers(chunks)
    # One graph serves every layer (parameters are graph inputs), but guards may still specialise per layer.
    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 4 * len(layers) + 8)
    mode = "reduce-overhead" if cuda_graph_warmup is not None and device.type == "cuda" else None
    compiled = [layer for layer in layers if _compile_layer(layer, tensor_parallel, mode)]
    if mode is not None:
        for layer in compiled:
            layer.forward = cuda_graph_warmup_forwards(layer.forward, type(layer).forward.__get__(layer),
                                                       cuda_graph_warmup)
    if not compiled:
        if layers:
            print_rank_0("longspan: torch.compile: nothing to compile (under tensor parallel these layers' "
                         "attention and MLP both stay eager); training runs eager", _log)
        return False
    _report_warmup(compiled[0], len(compiled))
    return True


def _eager_parts(layer: nn.Module) -> list[str]:
    """Names of the layer's sub-blocks that would put a graph break into a compiled layer: ``'mlp'`` for an
    MoE layer (its dispatch), ``'self_attention'`` when its core is checkpointed (selective recompute) or
    replaced (context parallel's attention)."""
    parts = []
    attention = getattr(layer, "self_attention", None)
    if attention is not None and (getattr(attention, "recompute_core_attention", False)
                                  or getattr(attention, "core_attention", core_attention) is not core_attention):
        parts.append("self_attention")
    if getattr(getattr(layer, "mlp", None), "is_moe", False):
        parts.append("mlp")
    return parts


def cuda_graph_warmup_forwards(graphed: Any, eager: Any, warmup: int) -> Any:
    """A layer forward that runs ``eager`` for its first ``warmup`` training forwards (grad enabled), then
    ``graphed``: megatron-core's cuda_graph_warmup_steps, the runs before a layer's graph is captured."""
    done = [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if done[0] < warmup and torch.is_grad_enabled():
            done[0] += 1
            return eager(*args, **kwargs)
        return graphed(*args, **kwargs)

    return forward


def _compile_layer(layer: nn.Module, tensor_parallel: int, mode: Optional[str] = None) -> bool:
    """Compile ``layer`` in place: its whole forward, or under tensor parallel with eager parts, each other
    sub-block's forward. Returns whether anything was compiled.

    Why the split under tensor parallel: the TP plans' DTensor hooks traced into a layer with a graph break give
    gradients that cross the break without their DTensor placements (torch 2.13): with sequence parallel and
    selective recompute the gradients below the break were wrong (input norm, earlier layers, embedding; no
    error), and with an MoE layer the backward raised "'Tensor' object has no attribute '_local_tensor'".
    A sub-block compiled whole has plain local tensors at both ends, like a whole layer."""
    eager = _eager_parts(layer)
    _keep_moe_dispatch_eager(layer)
    _keep_recomputed_attention_eager(layer)
    if tensor_parallel > 1 and eager:
        blocks = [getattr(layer, name, None) for name in ("self_attention", "mlp") if name not in eager]
        blocks = [block for block in blocks if block is not None]
        for block in blocks:
            block.forward = torch.compile(block.forward, mode=mode)
        return bool(blocks)
    layer.forward = torch.compile(layer.forward, mode=mode)
    return True


def _keep_recomputed_attention_eager(layer: nn.Module) -> None:
    """With selective recompute, run the checkpointed attention core (SDPA, or context parallel's attention)
    eager: the compiled layer graph-breaks around it and the rest (projections, rotary, norms, MLP) compiles.

    Why: a ``torch.utils.checkpoint`` region traced inside the compiled layer fails under tensor parallel
    ("expected all tensors_saved_with_vc_check to be Tensors", torch 2.13); the core is one fused kernel
    anyway, so compiling it gains little."""
    attention = getattr(layer, "self_attention", None)
    if getattr(attention, "recompute_core_attention", False):
        attention.core_attention = torch.compiler.disable(attention.core_attention)


def _keep_moe_dispatch_eager(layer: nn.Module) -> None:
    """Leave an MoE layer's ``dispatch_and_combine`` (permute, all-to-all, per-expert matmuls, unpermute) out of
    the compiled graph; the router, shared experts, attention and norms around it still compile.

    Why: the per-expert token counts change every step, so a traced dispatch recompiles for new counts (12
    graphs and ~75 s of warm-up for a 2-layer MoE on 2 CPU cores, against 5 graphs with it eager), and under
    expert parallel the traced experts failed ("GroupedMLP: 2 token counts for 4 local experts", torch 2.13)."""
    mlp = getattr(layer, "mlp", None)
    dispatcher = getattr(mlp, "token_dispatcher", None)
    if getattr(mlp, "is_moe", False) and dispatcher is not None:
        dispatcher.dispatch_and_combine = torch.compiler.disable(dispatcher.dispatch_and_combine)
    if getattr(mlp, "layer_recompute", False):
        # moe_layer_recompute: the checkpointed MoE layer (with its eager dispatch inside) runs eager as a whole,
        # so its replay in backward takes the same path as its forward
        mlp.forward = torch.compiler.disable(mlp.forward)


def _report_warmup(first_layer: nn.Module, count: int) -> None:
    """Say, when the second microbatch reaches the first compiled layer, how long the first one took
    (forward and backward, where the compilation happens)."""
    start: list[float] = []

    def hook(module: nn.Module, args: Any) -> None:
        if not start:
            start.append(time.perf_counter())
            return
        handle.remove()
        print_rank_0(
            f"longspan: torch.compile warm-up: {time.perf_counter() - start[0]:.1f} s for the first microbatch "
            f"(forward + backward, {count} compiled layers)", _log,
        )

    handle = first_layer.register_forward_pre_hook(hook)
