"""Megatron's optimizer surface over torch optimizers (AdamW / Adam / SGD / Muon with AdamW).

``get_megatron_optimizer`` builds Megatron-style param groups (no weight decay on biases and 1-D params such
as norm weights) and wraps a torch optimizer in ``MegatronOptimizer``, whose ``step()`` returns
``(update_successful, grad_norm, num_zeros_in_grad)`` like megatron-core's:

1. low-precision parameters (``params_dtype`` fp16/bf16) get fp32 main copies that the torch optimizer
   updates (megatron-core's ``Float16OptimizerWithFloat16Params``); their gradients are copied over first;
2. with a loss scaler (fp16, or any ``loss_scale``), gradients are unscaled and checked for inf/nan; on
   overflow the update is skipped (``(False, None, None)``) and the scaler backs off;
3. the global gradient norm is computed (DTensor-aware: tensor-parallel / FSDP2 shards add up to the full
   norm) and gradients are clipped to ``clip_grad`` when it is > 0;
4. zeros in the gradients are counted when ``log_num_zeros_in_grad``;
5. the torch optimizer steps and fp32 main params are copied back into the model.

Unlike megatron-core the norm is returned even when ``clip_grad`` is 0 (the trainer logs it).

With ``use_precision_aware_optimizer`` (megatron-core's TransformerEngine FusedAdam path) the main params are
kept in ``main_params_dtype`` (fp32 or fp16), the main gradients in ``main_grads_dtype`` (fp32 or bf16, as
``decoupled_grad``) and Adam's moments in ``exp_avg_dtype`` / ``exp_avg_sq_dtype``
(``longspan.training.optim.precision_aware_adam``); the update itself is computed in fp32.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from longspan.config.schema.optim import OptimizerConfig
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.core.logging import get_logger, print_rank_0
from longspan.training.optim.cpu_offload import offload_optimizer
from longspan.training.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from longspan.training.optim.muon import muon_optimizer
from longspan.training.optim.partial_grads import reduce_partial_grads
from longspan.training.optim.precision_aware_adam import PrecisionAwareAdamW, main_grad

try:  # DTensor is part of torch.distributed; absent only on builds without distributed support.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["MegatronOptimizer", "get_megatron_optimizer", "get_param_groups"]

logger = get_logger(__name__)

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's data (a DTensor's local shard, else the tensor itself)."""
    return t._local_tensor if _is_dtensor(t) else t


def _placement_key(t: torch.Tensor) -> Any:
    """Grouping key so tensors reduced together share a mesh and placements."""
    return (id(t.device_mesh), tuple(t.placements))


class NonFiniteGradError(RuntimeError):
    """The global gradient norm is NaN or Inf and no loss scaler can skip the step."""

    def __init__(self, grad_norm: float) -> None:
        super().__init__(f"gradient norm is {grad_norm}")
        self.grad_norm = grad_norm


class MegatronOptimizer:
    """A torch optimizer behind megatron-core's optimizer interface.

    Args:
        optimizer: the torch optimizer over the param groups (low-precision params are replaced in its
            groups by fp32 main copies here).
        config: the run's ``OptimizerConfig`` (``clip_grad``, ``log_num_zeros_in_grad``, precision-aware dtypes).
        grad_scaler: loss scaler, or None (bf16 without ``loss_scale``, fp32).

    Attributes:
        grad_stats_parallel_group: process group over which gradient statistics are summed after DTensor
            gradients have been reduced over their own meshes: the pipeline-parallel group, whose stages hold
            different parameters. None (the default) means every rank holds the whole model.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: MegatronGradScaler | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.config = config
        self.grad_scaler = grad_scaler
        self.grad_stats_parallel_group: dist.ProcessGroup | None = None
        # Without a loss scaler a non-finite gradient norm raises NonFiniteGradError before the update.
        self.check_for_nan_in_grad = False

        # Precision-aware optimizer (megatron-core's use_precision_aware_optimizer): main params in
        # main_params_dtype, main gradients in main_grads_dtype, held as ``decoupled_grad`` since a tensor's
        # ``grad`` must have its dtype. Otherwise fp32 main params with fp32 ``grad``.
        self.precision_aware = bool(config.use_precision_aware_optimizer)
        main_dtype = config.main_params_dtype if self.precision_aware else torch.float32
        self.main_grads_dtype = (config.main_grads_dtype if self.precision_aware
                                 else torch.float32)

        # (model_param, main_param) pairs per group, as megatron-core's float16/fp32_from_float16 groups.
        self.float16_groups: list[list[nn.Parameter]] = []
        self.fp32_from_float16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[nn.Parameter]] = []
        for group in self.optimizer.param_groups:
            f16, main, f32 = [], [], []
            for i, param in enumerate(group["params"]):
                if param.dtype in _LOW_PRECISION:
                    main_param = nn.Parameter(param.detach().clone().to(main_dtype))
                    group["params"][i] = main_param
                    if param in self.optimizer.state:
                        self.optimizer.state[main_param] = self.optimizer.state.pop(param)
                    f16.append(param)
                    main.append(main_param)
                else:
                    f32.append(param)
            self.float16_groups.append(f16)
            self.fp32_from_float16_groups.append(main)
            self.fp32_from_fp32_groups.append(f32)
        self._has_float16 = any(self.float16_groups)

        device = self._first_device()
        self._scale_one = torch.ones(1, dtype=torch.float, device=device)
        self._found_inf = torch.zeros(1, dtype=torch.float, device=device)

    def _first_device(self) -> torch.device:
        for param in self.get_parameters():
            return torch.device(param.device)
        return torch.device("cpu")

    # ------------------------------------------------------------------ torch-optimizer-like surface
    @property
    def param_groups(self) -> list[dict]:
        """The torch optimizer's param groups (the scheduler writes ``lr`` / ``weight_decay`` here)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The torch optimizer's per-parameter state."""
        return self.optimizer.state

    def get_parameters(self) -> list[torch.Tensor]:
        """The parameters the torch optimizer updates (fp32 main copies for low-precision params)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def get_model_parameters(self) -> list[torch.Tensor]:
        """The model's own parameters (the low-precision ones where main copies exist)."""
        params: list[torch.Tensor] = []
        for f16, f32 in zip(self.float16_groups, self.fp32_from_fp32_groups):
            params.extend(f16)
            params.extend(f32)
        return params

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of model params and main params."""
        for param in self.get_model_parameters() + [p for g in self.fp32_from_float16_groups for p in g]:
            if getattr(param, "decoupled_grad", None) is not None:
                param.decoupled_grad = None
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                if param.grad.grad_fn is not None:
                    param.grad.detach_()
                else:
                    param.grad.requires_grad_(False)
                param.grad.zero_()

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale, shape ``[1]`` (ones without a scaler)."""
        if self.grad_scaler is None:
            return self._scale_one
        return self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (unchanged without a scaler); keeps the loss's shape."""
        if self.grad_scaler is None:
            return loss
        return loss * self.grad_scaler.scale.to(loss.device).reshape(())

    def reload_model_params(self, state_dict: Any = None) -> None:
        """Refresh fp32 main params from the model's (after weights were loaded outside the optimizer)."""
        with torch.no_grad():
            for f16, main in zip(self.float16_groups, self.fp32_from_float16_groups):
                for model_param, main_param in zip(f16, main):
                    main_param.copy_(model_param)

    def copy_main_params_to_model_params(self) -> None:
        """Write the fp32 main params into the low-precision model params (e.g. after loading them)."""
        with torch.no_grad():
            for f16, main in zip(self.float16_groups, self.fp32_from_float16_groups):
                for model_param, main_param in zip(f16, main):
                    model_param.copy_(main_param)

    def main_params_module(self, model: nn.Module) -> nn.Module:
        """A module whose ``named_parameters()`` are ``model``'s names bound to the params this optimizer updates.

        For low-precision params that is the fp32 main copy, otherwise the model param itself. Checkpointing
        passes it to ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (which maps the
        torch optimizer's params to names through the module) and saves its ``state_dict()`` as the fp32
        master weights; after loading, call :meth:`copy_main_params_to_model_params`.
        """
        main_of = {
            id(model_param): main_param
            for f16, main in zip(self.float16_groups, self.fp32_from_float16_groups)
            for model_param, main_param in zip(f16, main)
        }
        root = nn.Module()
        for name, param in model.named_parameters():
            *path, leaf = name.split(".")
            module = root
            for part in path:
                if part not in module._modules:
                    module.add_module(part, nn.Module())
                module = module._modules[part]
            # The very same Parameter objects: DCP matches optimizer params to names by identity.
            module.register_parameter(leaf, main_of.get(id(param), param))
        return root

    # ------------------------------------------------------------------ gradient statistics
    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        """Gradients counted in the norm: every non-None main gradient, except parameters marked ``shared``
        (a tied output layer's copy on the last pipeline stage: its gradient is the embedding's, counted once),
        as megatron-core's ``param_is_not_shared``."""
        grads = [main_grad(p) for p in self.get_parameters() if not getattr(p, "shared", False)]
        return [g for g in grads if g is not None]

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """L2 norm of all gradients together, over every shard of every DTensor."""
        return float(_global_grad_norm(self.get_main_grads_for_grad_norm(), self.grad_stats_parallel_group))

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        """Compute the global gradient norm and scale gradients down so it is at most ``clip_grad``."""
        grads = self.get_main_grads_for_grad_norm()
        total_norm = _global_grad_norm(grads, self.grad_stats_parallel_group)
        # Same coefficient as megatron-core and torch.nn.utils.clip_grad_norm_.
        clip_coeff = clip_grad / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            # every gradient is scaled, the shared copies' too (counted once in the norm, but stepped on every
            # stage that holds one: megatron-core clips all parameters' gradients)
            every = [g for g in (main_grad(p) for p in self.get_parameters()) if g is not None]
            for local_grads in _by_device([_local(g) for g in every]).values():
                torch._foreach_mul_(local_grads, clip_coeff)
        return float(total_norm)

    @torch.no_grad()
    def count_zeros(self) -> int:
        """Number of zero entries in all gradients (each DTensor element counted once)."""
        total = 0.0
        plain = 0.0
        groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
        for grad in self.get_main_grads_for_grad_norm():
            if _is_dtensor(grad):
                groups[_placement_key(grad)].append(grad)
            else:
                plain += float(grad.numel() - torch.count_nonzero(grad).item())
        for grads in groups.values():
            count = None
            for grad in grads:
                zeros = (grad == 0).sum()
                count = zeros if count is None else count + zeros
            total += float(count.full_tensor().item())
        if self.grad_stats_parallel_group is not None:
            t = torch.tensor([total + plain], dtype=torch.float64, device=self._found_inf.device)
            dist.all_reduce(t, group=self.grad_stats_parallel_group)
            return int(t.item())
        return int(total + plain)

    # ------------------------------------------------------------------ stepping
    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Copy model grads to main grads, unscale and check for inf/nan; returns whether any was found."""
        for f16, main in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(f16, main):
                # An unused param has no grad this iteration: never step it with a stale one.
                grad = model_param.grad
                if self.precision_aware:
                    main_param.decoupled_grad = None if grad is None else grad.to(self.main_grads_dtype)
                else:
                    main_param.grad = None if grad is None else grad.float()
                model_param.grad = None
        reduce_partial_grads(self.get_parameters())  # once here, not in the norm and again in the step
        if self.grad_scaler is None:
            return False

        self._found_inf.fill_(0.0)
        inv_scale = self.grad_scaler.inv_scale
        by_device = _by_device([_local(g) for g in self.get_main_grads_for_grad_norm()])
        for device, grads in by_device.items():
            found = self._found_inf if device == self._found_inf.device else self._found_inf.to(device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))
            if found is not self._found_inf:
                self._found_inf.copy_(torch.maximum(self._found_inf, found.to(self._found_inf.device)))
        # Every rank must agree to skip, whichever shard overflowed.
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self._found_inf, op=dist.ReduceOp.MAX)
        found_inf = bool(self._found_inf.item() > 0)
        self.grad_scaler.update(found_inf)
        return found_inf

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Step the torch optimizer, then copy fp32 main params back into low-precision model params."""
        self.optimizer.step()
        if self._has_float16:
            self.copy_main_params_to_model_params()
        return True

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        """One update: ``(update_successful, grad_norm, num_zeros_in_grad)``.

        On an inf/nan gradient with a scaler active the update is skipped: ``(False, None, None)``.
        ``num_zeros_in_grad`` is None unless ``log_num_zeros_in_grad``.
        """
        if self.prepare_grads():
            return False, None, None
        clip_grad = float(self.config.clip_grad or 0.0)
        grad_norm = self.clip_grad_norm(clip_grad) if clip_grad > 0.0 else self.get_grad_norm()
        if self.check_for_nan_in_grad and not math.isfinite(grad_norm):
            # Megatron's check_for_nan_in_loss_and_grad: stop before a NaN/Inf gradient reaches the weights.
            raise NonFiniteGradError(grad_norm)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        success = self.step_with_ready_grads()
        return success, grad_norm, num_zeros

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """``{'optimizer': torch state, 'grad_scaler': ... (if any), 'fp32_from_fp16_params': ... (if any)}``.

        The layout is megatron-core's ``Float16OptimizerWithFloat16Params`` one for every precision, so a
        checkpoint always finds the scaler in the same place.
        """
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        if self._has_float16:
            state["fp32_from_fp16_params"] = self.fp32_from_float16_groups
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` wrote (a bare torch optimizer state dict is accepted too)."""
        if "optimizer" not in state_dict and "state" in state_dict:
            self.optimizer.load_state_dict(state_dict)
            return
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if "grad_scaler" in state_dict:
            if self.grad_scaler is not None:
                self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
            else:
                print_rank_0("checkpoint has a grad scaler state but this run uses none; ignoring it", logger)
        if "fp32_from_fp16_params" in state_dict and self._has_float16:
            with torch.no_grad():
                for current, saved in zip(self.fp32_from_float16_groups, state_dict["fp32_from_fp16_params"]):
                    for cur, sav in zip(current, saved):
                        cur.copy_(sav)
        elif self._has_float16:
            # No saved main params: rebuild them from the (already loaded) model weights.
            self.reload_model_params()


def _by_device(tensors: Iterable[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        out[t.device].append(t)
    return out


def _global_grad_norm(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor:
    """L2 norm over all ``grads``: DTensors reduced over their meshes, plain tensors over ``group`` if given.

    DTensors are grouped by (mesh, placements) so each group's norm is one reduction (torch's
    ``get_total_norm`` handles DTensor lists of one placement); the groups combine as a sum of squares.
    Computed in float32 like megatron-core's ``get_grad_norm_fp32`` (low-precision gradients of the
    precision-aware optimizer are normed with fp32 accumulation).
    """
    device = grads[0].device if grads else torch.device("cpu")
    sq_dtensor = torch.zeros((), dtype=torch.float32, device=device)
    sq_plain = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
    plain: list[torch.Tensor] = []
    for g in grads:
        (groups[_placement_key(g)] if _is_dtensor(g) else plain).append(g)
    for dgrads in groups.values():
        norm = _total_norm(dgrads)
        norm = norm.full_tensor() if _is_dtensor(norm) else norm
        sq_dtensor = sq_dtensor + norm.float().to(device) ** 2
    if plain:
        sq_plain = _total_norm(plain).float().to(device) ** 2
    total_sq = sq_dtensor + sq_plain
    if group is not None:
        # Pipeline stages hold different parameters, DTensor ones included (their meshes are per stage).
        dist.all_reduce(total_sq, group=group)
    return torch.sqrt(total_sq)


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of ``grads`` (one placement if DTensors); fp32 accumulation when any is fp16/bf16."""
    if all(g.dtype == torch.float32 for g in grads):
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


# Megatron marks the input embedding and the output layer (``is_embedding_or_output_parameter``). The mark is an
# attribute that FSDP2's DTensor parameters and meta-device materialization do not carry over, so longspan goes
# by the parameter's name, which every wrapper keeps (a suffix: pipeline stages and compile add prefixes).
_EMBEDDING_OR_OUTPUT_SUFFIXES = ("word_embeddings.weight", "output_layer.weight")


def is_embedding_or_output_parameter(name: str, param: nn.Parameter) -> bool:
    """Whether ``param`` is the input embedding or the output layer: the params ``optimizer.decoupled_lr`` takes."""
    if getattr(param, "is_embedding_or_output_parameter", False):
        return True
    return name.endswith(_EMBEDDING_OR_OUTPUT_SUFFIXES)


def get_param_groups(
    model_chunks: list[nn.Module],
    config: OptimizerConfig,
    no_weight_decay_cond: Callable[[str, nn.Parameter], bool] | None = None,
    scale_lr_cond: Callable[[str, nn.Parameter], bool] | None = None,
    lr_mult: float = 1.0,
) -> list[dict]:
    """Megatron-style param groups keyed by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr).

    No weight decay (``wd_mult`` 0) on params where ``no_weight_decay_cond(name, param)`` holds, by default
    biases and every 1-D parameter (norm weights), except the QK-norm's with ``apply_wd_to_qk_layernorm``. Params where ``scale_lr_cond`` holds get ``lr_mult``:
    their group's ``max_lr`` / ``min_lr`` are ``lr * lr_mult`` / ``min_lr * lr_mult`` (megatron-core 0.16's
    scheduler reads only those). Params with ``is_embedding_or_output_parameter`` use
    ``decoupled_lr`` / ``decoupled_min_lr`` when set. Frozen params are skipped. Groups come in a fixed
    order so every run and layout builds the same group list.
    """
    lr = config.lr
    if lr is None:
        raise ConfigError("optimizer.lr=None is invalid: set the peak learning rate, e.g. optimizer.lr=3e-4")
    min_lr = config.min_lr or 0.0
    decoupled_lr = config.decoupled_lr
    decoupled_min_lr = config.decoupled_min_lr
    weight_decay = config.weight_decay
    apply_wd_to_qk_layernorm = bool(config.apply_wd_to_qk_layernorm)

    params_map: dict[tuple, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if no_weight_decay_cond is not None:
                no_wd = bool(no_weight_decay_cond(name, param))
            else:
                no_wd = name.endswith(".bias") or len(param.shape) == 1
                if apply_wd_to_qk_layernorm and ("q_layernorm." in name or "k_layernorm." in name):
                    no_wd = False  # Qwen3-Next's rule (megatron-core): the QK-norm weights are decayed too
            scale_lr = bool(scale_lr_cond(name, param)) if scale_lr_cond is not None else False
            wd_mult = 0.0 if no_wd else 1.0
            group_lr_mult = float(lr_mult) if scale_lr else 1.0
            is_expert_parallel = not getattr(param, "allreduce", True)
            is_decoupled_lr = decoupled_lr is not None and is_embedding_or_output_parameter(name, param)
            params_map.setdefault((wd_mult, group_lr_mult, is_expert_parallel, is_decoupled_lr), []).append(param)

    groups = []
    # Decaying groups first, then by the other keys: a fixed order independent of parameter order.
    for key in sorted(params_map, key=lambda k: (-k[0], k[1], k[2], k[3])):
        wd_mult, group_lr_mult, is_expert_parallel, is_decoupled_lr = key
        if is_decoupled_lr:
            max_lr = decoupled_lr
            group_min_lr = decoupled_min_lr if decoupled_min_lr is not None else min_lr
        else:
            max_lr = lr * group_lr_mult
            group_min_lr = min_lr * group_lr_mult
        groups.append(
            {
                "params": params_map[key],
                "wd_mult": wd_mult,
                "lr_mult": group_lr_mult,
                "is_expert_parallel": is_expert_parallel,
                "is_decoupled_lr": is_decoupled_lr,
                # The group whose lr the trainer logs: the unmodified schedule.
                "default_config": group_lr_mult == 1.0 and not is_decoupled_lr,
                "max_lr": max_lr,
                "min_lr": group_min_lr,
                "lr": max_lr,
                "weight_decay": weight_decay * wd_mult,
            }
        )
    return groups


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: list[nn.Module],
    no_weight_decay_cond: Callable[[str, nn.Parameter], bool] | None = None,
    scale_lr_cond: Callable[[str, nn.Parameter], bool] | None = None,
    lr_mult: float = 1.0,
) -> MegatronOptimizer:
    """Build the optimizer of ``model_chunks`` from an ``OptimizerConfig`` (Megatron Core field names).

    ``optimizer='adam'`` is AdamW (decoupled weight decay) unless ``decoupled_weight_decay`` is False
    (then torch Adam with L2 weight decay); ``'sgd'`` is SGD with ``sgd_momentum``; ``'muon'`` Muon. A loss scaler is used
    as in megatron-core: ``loss_scale`` set (with fp16 or bf16) gives a constant scaler, fp16 without it a
    dynamic one (initial_loss_scale, min_loss_scale, growth 2, backoff 0.5, loss_scale_window, hysteresis).
    ``use_precision_aware_optimizer`` gives :class:`PrecisionAwareAdamW` (moments in ``exp_avg_dtype`` /
    ``exp_avg_sq_dtype``) with main params in ``main_params_dtype`` and main grads in ``main_grads_dtype``.
    """
    name = config.optimizer
    precision_aware = bool(config.use_precision_aware_optimizer)
    if precision_aware and name != "adam":
        raise ConfigError(f"optimizer.use_precision_aware_optimizer=True works with optimizer='adam' only, not {name!r}")
    offload = bool(config.optimizer_cpu_offload)
    if offload and precision_aware:
        raise NotSupportedError("optimizer.optimizer_cpu_offload=True is not supported yet with "
                                "optimizer.use_precision_aware_optimizer=True: set one of them to False")
    param_groups = get_param_groups(model_chunks, config, no_weight_decay_cond, scale_lr_cond, lr_mult)
    if not param_groups:
        raise ConfigError("model has no trainable parameters: the optimizer needs at least one")
    all_params = [p for g in param_groups for p in g["params"]]
    if name == "muon":  # the weight matrices with Muon, the rest with AdamW (longspan.training.optim.muon)
        optimizer = muon_optimizer(config, model_chunks, param_groups, is_embedding_or_output_parameter, _fast_kernels)
    else:
        optimizer = _torch_optimizer(config, name, precision_aware, param_groups, _fast_kernels(all_params, name))
    grad_scaler = _grad_scaler(config, all_params[0].device)
    megatron_optimizer = MegatronOptimizer(optimizer, config, grad_scaler)
    if offload:  # over the groups MegatronOptimizer left: fp32 main copies in place of low-precision params
        megatron_optimizer.optimizer = offload_optimizer(optimizer, config, lambda groups: _torch_optimizer(
            config, name, False, groups, _fast_kernels([p for g in groups for p in g["params"]], name)))
    return megatron_optimizer


def _fast_kernels(all_params: list[nn.Parameter], name: str = "adam") -> dict[str, bool]:
    """The fused/foreach keyword for torch's optimizer ``name`` ('adam' or 'sgd') that these parameters allow."""
    dtensors = [p for p in all_params if _is_dtensor(p)]
    if not dtensors:
        # torch's fused kernels (one pass over each tensor instead of ~10 foreach ops: 15x faster AdamW on a
        # CPU, benchmarks/bench_train_step.py) need every tensor on CUDA or every tensor on the CPU.
        device_types = {p.device.type for p in all_params}
        return {"fused": True} if device_types in ({"cuda"}, {"cpu"}) else {"foreach": True}
    # foreach kernels reject lists mixing DTensors with plain tensors or DTensors of different meshes
    # (e.g. tensor parallel leaving norm weights unsharded): fall back to the per-tensor loop then.
    one_mesh = len({id(p.device_mesh) for p in dtensors}) == 1
    # DTensor has sharding rules for the fused Adam/AdamW kernels (not SGD's): one kernel per step instead of
    # ~10 foreach ops, each dispatched through DTensor
    if (name == "adam" and len(dtensors) == len(all_params) and one_mesh
            and {p.device.type for p in dtensors} in ({"cuda"}, {"cpu"})):
        return {"fused": True}
    return {"foreach": len(dtensors) == len(all_params) and one_mesh}


def _torch_optimizer(config: OptimizerConfig, name: str, precision_aware: bool, param_groups: list[dict[str, Any]],
                     fast: dict[str, bool]) -> torch.optim.Optimizer:
    """The torch optimizer ``optimizer.optimizer`` names (AdamW, Adam, SGD, or the precision-aware AdamW)."""
    lr = config.lr
    weight_decay = config.weight_decay
    betas = (config.adam_beta1, config.adam_beta2)
    eps = config.adam_eps
    if precision_aware:
        # Moments stored in exp_avg_dtype / exp_avg_sq_dtype, update computed in fp32 (precision_aware_adam).
        return PrecisionAwareAdamW(
            param_groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
            decoupled_weight_decay=config.decoupled_weight_decay,
            exp_avg_dtype=config.exp_avg_dtype,
            exp_avg_sq_dtype=config.exp_avg_sq_dtype,
        )
    if name == "adam":
        cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        return cls(param_groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, **fast)
    if name == "sgd":
        momentum = config.sgd_momentum
        return torch.optim.SGD(param_groups, lr=lr, weight_decay=weight_decay, momentum=momentum, **fast)
    raise ConfigError(f"optimizer.optimizer={name!r} is invalid: valid optimizers are 'adam', 'sgd' and 'muon'")


def _grad_scaler(config: OptimizerConfig, device: torch.device) -> MegatronGradScaler | None:
    """Megatron-core's loss scaler: constant with ``loss_scale`` (fp16 or bf16), dynamic for fp16 without it."""
    if not (config.fp16 or config.bf16):
        return None
    loss_scale = config.loss_scale
    if loss_scale:
        return ConstantGradScaler(loss_scale, device=device)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
            device=device,
        )
    return None
