"""Rules of ``ConfigContainer.validate()`` for the model's memory and kernel features that map onto torch's own
mechanisms: activation offload (``longspan.parallel.offload``), asynchronous tensor parallel
(``longspan.parallel.async_tp``), the attention backend (``longspan.models.attention_backend``), CUDA graphs
(``longspan.parallel.compile``) and the per-group NCCL options (``longspan.parallel.nccl_options``). They hold on every machine, so a config checked on a CPU is valid on a GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from longspan.config.nccl_groups import nccl_group_settings
from longspan.core.errors import ConfigError, NotSupportedError

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer


def check_activation_offload(cfg: "ConfigContainer") -> None:
    """model.cpu_offloading: a layer count below num_layers (as Megatron), no activation recompute (the two
    would fight over the same saved tensors; Megatron refuses it too), and no torch.compile of the layers."""
    m = cfg.model
    if not m.cpu_offloading:
        return
    count, layers = m.cpu_offloading_num_layers, m.num_layers
    if not isinstance(count, int) or not 0 <= count < layers:
        raise ConfigError(f"model.cpu_offloading_num_layers={count!r} must be at least 0 and below "
                          f"model.num_layers={layers}")
    if not (m.cpu_offloading_activations or m.cpu_offloading_weights):
        raise ConfigError("model.cpu_offloading=True offloads nothing with cpu_offloading_activations=False and "
                          "cpu_offloading_weights=False: turn one on or turn cpu_offloading off")
    if m.recompute_granularity is not None:
        raise ConfigError(f"model.cpu_offloading=True with model.recompute_granularity={m.recompute_granularity!r}: "
                          "offload and recompute both manage the saved activations; choose one")
    if cfg.train.torch_compile:
        raise NotSupportedError("model.cpu_offloading=True with train.torch_compile=True is not supported yet by "
                                "longspan: offloaded layers run eager; set train.torch_compile=false or null")


def check_async_tensor_parallel(cfg: "ConfigContainer") -> None:
    """model.tp_comm_overlap overlaps the sequence-parallel collectives inside compiled layers: it needs
    sequence_parallel (as Megatron) and a train.torch_compile that is not False."""
    m = cfg.model
    if not m.tp_comm_overlap:
        return
    if not m.sequence_parallel:
        raise ConfigError("model.tp_comm_overlap=True needs model.sequence_parallel=True (the overlapped collectives "
                          "are sequence parallel's all-gather and reduce-scatter)")
    if cfg.train.torch_compile is False:
        raise ConfigError("model.tp_comm_overlap=True runs inside the compiled layers: set train.torch_compile=true "
                          "or null, or model.tp_comm_overlap=false")


# Megatron's AttnBackend names (longspan.models.attention_backend maps each onto SDPA kernels).
ATTENTION_BACKEND_NAMES = ("auto", "flash", "fused", "unfused", "local")


def check_attention_backend(cfg: "ConfigContainer") -> None:
    """model.attention_backend is one of Megatron's AttnBackend names."""
    backend = cfg.model.attention_backend
    if backend not in ATTENTION_BACKEND_NAMES:
        raise ConfigError(f"model.attention_backend={backend!r} is not valid: use one of "
                          f"{', '.join(ATTENTION_BACKEND_NAMES)}")


def check_cuda_graphs(cfg: "ConfigContainer") -> None:
    """model.enable_cuda_graph / external_cuda_graph capture the compiled layers (torch.compile's CUDA-graph trees,
    longspan.parallel.compile): one of the two (as megatron-core), a train.torch_compile that is not False, no
    activation offload (offloaded layers run eager), no full recompute (megatron-core allows it only with whole-
    iteration graphs); cuda_graph_warmup_steps a count >= 0, set only with them."""
    m = cfg.model
    enable, external = m.enable_cuda_graph, m.external_cuda_graph
    warmup = m.cuda_graph_warmup_steps
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"model.cuda_graph_warmup_steps={warmup!r} must be an integer >= 0")
    if not enable and not external:
        if warmup != 3:
            raise ConfigError(f"model.cuda_graph_warmup_steps={warmup} is read only with model.enable_cuda_graph=True "
                              "(or external_cuda_graph): set one or leave it at 3")
        return
    if enable and external:
        raise ConfigError("model.enable_cuda_graph=True and model.external_cuda_graph=True cannot be set together "
                          "(megatron-core): keep one")
    name = "enable_cuda_graph" if enable else "external_cuda_graph"
    if cfg.train.torch_compile is False:
        raise ConfigError(f"model.{name}=True captures the compiled layers (torch.compile mode='reduce-overhead'): "
                          "set train.torch_compile=true or null")
    if m.cpu_offloading:
        raise ConfigError(f"model.{name}=True with model.cpu_offloading=True: offloaded layers run eager and "
                          "cannot be captured; choose one")
    if m.recompute_granularity == "full":
        raise ConfigError(f"model.{name}=True with model.recompute_granularity='full': full recompute replays "
                          "whole layers in the backward pass, which per-layer graphs cannot (megatron-core's rule); "
                          "use 'selective' or None")


def check_device_features(cfg: "ConfigContainer") -> None:
    """Every rule of this module, in order."""
    check_activation_offload(cfg)
    check_async_tensor_parallel(cfg)
    check_cuda_graphs(cfg)
    check_attention_backend(cfg)
    nccl_group_settings(cfg.dist)  # group names and the communicator file, checked on every machine
