"""The compiled fast path: ``torch.compile`` per transformer layer, applied from outside after the parallel plans.

``compile_model(chunks, cfg, device)`` replaces each transformer layer's ``forward`` with a compiled one
(torchtitan's per-block compile). It runs after tensor/context/expert/data parallelism and pipeline
splitting, so every layout gets it the same way: the module tree, parameter names and the wrappers' hooks
(FSDP2's all-gathers, DDP's reducer, the TP plans' input/output hooks) stay as they were, and only the
layer's own computation is compiled. Activation recompute still wraps compiled layers
(``torch.utils.checkpoint`` recomputes through them), and MoE layers compile with graph breaks around their
data-dependent routing. Tensor parallel is not composed yet (see ``compile_model``); tested: one process and
DDP over 2 ranks.

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

from longspan.core.errors import NotSupportedError
from longspan.core.logging import get_logger, print_rank_0, warn_rank_0

_log = get_logger(__name__)

#: whether ``train.torch_compile=None`` compiles on a CPU (see the module docstring)
CPU_DEFAULT = False


def compile_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why this platform cannot run inductor-compiled code on ``device``, or None when it can."""
    try:
        from torch._dynamo.eval_frame import is_dynamo_supported

        if not is_dynamo_supported():
            return "torch.compile does not support this Python"
    except ImportError:
        return "this torch has no torch._dynamo"
    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:
            return "this torch cannot tell whether Triton is installed"
        return None if has_triton() else "Triton is not installed"
    if device.type == "cpu":
        if not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
            return "no C++ compiler (g++, c++ or clang++) on PATH"
        return None
    return f"device type {device.type!r} is not handled by longspan's compile plan"


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
                  tensor_parallel: int = 1) -> bool:
    """Compile each transformer layer's forward in place when ``setting`` resolves on; return whether it did.

    Not with tensor parallel yet: the TP plans' DTensor hooks inside a compiled layer give plain-tensor
    gradients where DTensors are expected (seen on torch 2.13), so ``True`` with tp > 1 is an error and the
    default runs eager there with a one-line note."""
    if not compile_enabled(setting, device):
        return False
    if tensor_parallel > 1:
        if setting:
            raise NotSupportedError(
                f"train.torch_compile=True with tensor_model_parallel_size={tensor_parallel} is not supported yet: "
                "set train.torch_compile=False (or leave it unset) or tensor_model_parallel_size=1"
            )
        print_rank_0(f"longspan: torch.compile is not applied with tensor_model_parallel_size={tensor_parallel} "
                     "yet (runs eager)", _log)
        return False
    reason = compile_unavailable_reason(device)
    if reason is not None:
        warn_rank_0(f"train.torch_compile: {reason}; training runs eager (set train.torch_compile=False to "
                    "silence this)")
        return False
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True  # eager's RNG: same dropout masks with and without compile
    layers = transformer_layers(chunks)
    # One graph serves every layer (parameters are graph inputs), but guards may still specialise per layer.
    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 2 * len(layers) + 8)
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
    if layers:
        _report_warmup(layers[0], len(layers))
    return bool(layers)


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
