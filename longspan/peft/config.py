"""The PEFT configs: Megatron Bridge's ``LoRA``, ``DoRA`` and ``CanonicalLoRA`` with their field names.

A config is data (it goes into ``ConfigContainer.peft`` and round-trips through YAML); ``apply`` turns a
model built on the meta device into an adapted one (``longspan.peft.adapters``), from outside the model, as
the parallel plans are.

Target names are Megatron's. Megatron fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``;
longspan keeps them apart (``linear_q/k/v``, ``linear_fc1_gate`` + ``linear_fc1``), so:

- ``LoRA``/``DoRA`` on ``linear_qkv`` adapt q, k and v with ONE shared ``A`` (rank ``dim`` over the input)
  and a ``B`` whose output rows are split over q, k and v (Megatron's fused adapter, exactly); the same for
  ``linear_fc1`` over gate and up;
- ``CanonicalLoRA`` gives each of ``linear_q``, ``linear_k``, ``linear_v``, ``linear_fc1_up``,
  ``linear_fc1_gate`` its own adapter.

A ``target_modules`` entry is a module name (``linear_qkv``) or an fnmatch pattern over the full Megatron
module path (``*.layers.0.*.linear_qkv``, ``decoder.layers.1.mlp.linear_fc2``); MoE experts are included
(``decoder.layers.N.mlp.experts.linear_fc1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from longspan.core.errors import ConfigError, NotSupportedError

INIT_METHODS = ("xavier", "kaiming", "normal", "zero")
MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
CANONICAL_TARGETS = ("linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_up", "linear_fc1_gate",
                     "linear_fc2")


@dataclass
class PEFT:
    """Base class of the adapter configs (Bridge's ``megatron.bridge.peft.base.PEFT``)."""

    #: which adapter flavour ``apply`` builds: 'lora', 'dora' or 'canonical'
    kind = "lora"

    def apply(self, model: Any) -> Any:
        """Add adapters to ``model`` (one chunk, on the meta device or materialized) and freeze everything
        else; returns the model. See ``longspan.peft.adapters.apply_adapters``."""
        # adapters need torch: the config classes stay importable without it (config files, CLI start-up)
        from longspan.peft.adapters import apply_adapters

        return apply_adapters(model, self)

    def __call__(self, model: Any, training: bool = True) -> Any:
        """Bridge's spelling: ``peft(model)`` applies the adapters (to each chunk of a list)."""
        chunks = model if isinstance(model, list) else [model]
        for chunk in chunks:
            self.apply(chunk)
        return model


@dataclass
class LowRankAdapterConfig(PEFT):
    """The fields LoRA, DoRA and CanonicalLoRA share (Bridge's names and order), and their checks.

    A subclass re-declares a field where its default or its description differs.
    """

    target_modules: list[str] = field(default_factory=lambda: list(MEGATRON_TARGETS))
    """Modules to adapt: 'linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2', or fnmatch patterns over full
    module paths ('*.layers.0.*.linear_qkv'). 'linear_qkv' shares one A over q/k/v; 'linear_fc1' over gate/up.
    Multi-latent attention's projections go by their own names: 'linear_q_proj' (or 'linear_q_down_proj',
    'linear_q_up_proj'), 'linear_kv_down_proj', 'linear_kv_up_proj'. Gated attention's output gate is part of
    'linear_qkv'; a gated DeltaNet layer's projections are 'in_proj' (q/k/v/z/b/a, one A) and 'out_proj', a
    Mamba-2 mixer's 'in_proj' (z/x/B/C/dt, one A) and 'out_proj'."""

    exclude_modules: list[str] = field(default_factory=list)
    """Modules (names or patterns) never adapted."""

    dim: int = 32
    """Rank of the adapter (rows of A, columns of B)."""

    alpha: int = 32
    """Scale numerator: the adapter output is multiplied by alpha / dim."""

    dropout: float = 0.0
    """Dropout probability on the adapter path."""

    dropout_position: Literal["pre", "post"] = "pre"
    """Dropout on the adapter's input ('pre') or on its output ('post')."""

    lora_A_init_method: str = "xavier"
    """Initialization of A (see LoRA)."""

    lora_B_init_method: str = "zero"
    """Initialization of B (see LoRA)."""

    base_quantization: Optional[str] = None
    """longspan's own field (Megatron Bridge has none): store the frozen base weights of the adapted linear
    layers in 4 bits, QLoRA's way. None keeps them in params_dtype; 'nf4' quantizes them to 4-bit NormalFloat
    (blocks of 64 along each row, a float32 absmax per block, no double quantization: 0.5625 byte per weight)
    once the base is loaded, and dequantizes each layer's weight in the compute dtype in forward and backward.
    The quantized base is not saved: resuming re-quantizes the pretrained base (deterministic). Not for DoRA."""

    def validate(self) -> None:
        """Check the fields (one-line ``ConfigError`` naming the field, the value and what is valid)."""
        name = f"peft ({type(self).__name__})"
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 1:
            raise ConfigError(f"{name}.dim={self.dim!r} must be a positive integer (the adapter rank)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ConfigError(f"{name}.alpha={self.alpha!r} must be a positive number (scale = alpha / dim)")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ConfigError(f"{name}.dropout={self.dropout!r} must be in [0, 1)")
        if self.dropout_position not in ("pre", "post"):
            raise ConfigError(f"{name}.dropout_position={self.dropout_position!r} must be 'pre' or 'post'")
        for fname in ("lora_A_init_method", "lora_B_init_method"):
            value = getattr(self, fname)
            if value not in INIT_METHODS:
                raise ConfigError(f"{name}.{fname}={value!r} must be one of {', '.join(INIT_METHODS)}")
        for fname in ("target_modules", "exclude_modules"):
            value = getattr(self, fname)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
                raise ConfigError(f"{name}.{fname}={value!r} must be a list of module names or patterns")
        if self.base_quantization not in (None, "nf4"):
            raise ConfigError(f"{name}.base_quantization={self.base_quantization!r} must be None or 'nf4'")
        if not self.target_modules and not self.exclude_modules:
            raise ConfigError(
                f"{name}.target_modules is empty: name the modules to adapt (e.g. {list(MEGATRON_TARGETS)}), or "
                "set exclude_modules to adapt every linear layer but those"
            )

    @property
    def scale(self) -> float:
        """The factor on the adapter's output: ``alpha / dim``."""
        return self.alpha / self.dim


@dataclass
class LoRA(LowRankAdapterConfig):
    """Low-rank adaptation (Megatron Bridge's ``LoRA``): ``y = W x + (alpha/dim) · B A dropout(x)``."""

    exclude_modules: list[str] = field(default_factory=list)
    """Modules (names or patterns) never adapted; with an empty target_modules every linear layer but these is."""

    lora_A_init_method: str = "xavier"
    """Initialization of A: 'xavier' (normal), 'kaiming' (uniform, a=sqrt(5)), 'normal' (std 0.2) or 'zero'."""

    lora_B_init_method: str = "zero"
    """Initialization of B (same choices); 'zero' makes the adapted model start equal to the base."""

    a2a_experimental: bool = False
    """Megatron's all-to-all communication for LoRA under sequence parallel: a communication choice that changes
    no maths; longspan's DTensor plans pick their own collectives (accepted, no effect)."""


@dataclass
class DoRA(LowRankAdapterConfig):
    """Weight-decomposed low-rank adaptation (Megatron Bridge's ``DoRA``):
    ``y = m ⊙ (W + s·B A) x / ||W + s·B A||_row + b`` with a trainable magnitude ``m`` per output row (initialized
    to the base weight's row norms) and the norm detached from the graph (DoRA paper, section 4.3), as peft."""

    target_modules: list[str] = field(default_factory=lambda: list(MEGATRON_TARGETS))
    """Modules to adapt (as LoRA.target_modules)."""

    dim: int = 32
    """Rank of the adapter."""

    alpha: int = 64
    """Scale numerator: the low-rank update is multiplied by alpha / dim."""

    dropout: float = 0.0
    """Dropout probability on the adapter's input."""

    dropout_position: Literal["pre", "post"] = "pre"
    """Only 'pre' (dropout on the adapter's input), as Megatron Bridge."""

    base_quantization: Optional[str] = None
    """longspan's own QLoRA switch (see LoRA.base_quantization); DoRA takes only None: its weight norm reads the
    whole base weight every step (any other value is a NotSupportedError)."""

    kind = "dora"

    def validate(self) -> None:
        super().validate()
        if self.base_quantization is not None:
            raise NotSupportedError(
                f"peft (DoRA).base_quantization={self.base_quantization!r}: DoRA's weight norm needs the whole base "
                "weight every step; use LoRA or CanonicalLoRA with an NF4 base, or base_quantization=None"
            )
        if self.dropout_position != "pre":
            raise ConfigError(
                f"peft (DoRA).dropout_position={self.dropout_position!r}: DoRA supports only 'pre' (as Megatron Bridge)"
            )


@dataclass
class CanonicalLoRA(LowRankAdapterConfig):
    """LoRA with a separate adapter for each of q, k, v and of gate, up (Megatron Bridge's ``CanonicalLoRA``;
    the layout of Hugging Face PEFT adapters)."""

    target_modules: list[str] = field(default_factory=lambda: list(CANONICAL_TARGETS))
    """Modules to adapt: 'linear_q', 'linear_k', 'linear_v', 'linear_proj', 'linear_fc1_up', 'linear_fc1_gate',
    'linear_fc2', or fnmatch patterns over full module paths. The fused names are rejected. A sequence mixer's
    projections (gated DeltaNet, Mamba-2) are 'in_proj_<segment>' each ('in_proj_q' ... 'in_proj_a';
    'in_proj_z', 'in_proj_x', 'in_proj_B', 'in_proj_C', 'in_proj_dt'), or 'in_proj' whole with one shared A (as
    Bridge's CanonicalLoRA), and 'out_proj'."""

    dim: int = 32
    """Rank of each adapter."""

    alpha: int = 32
    """Scale numerator: each adapter's output is multiplied by alpha / dim."""

    kind = "canonical"

    def validate(self) -> None:
        super().validate()
        fused = [t for t in self.target_modules if t.split(".")[-1] in ("linear_qkv", "linear_fc1")]
        if fused:
            raise ConfigError(
                f"peft (CanonicalLoRA).target_modules names fused modules {fused}: use linear_q, linear_k, "
                "linear_v (for linear_qkv) and linear_fc1_up, linear_fc1_gate (for linear_fc1), or use LoRA"
            )


PEFT_CLASSES = (LoRA, DoRA, CanonicalLoRA)
