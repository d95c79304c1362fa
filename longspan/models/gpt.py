"""The decoder-only GPT model, built from a ``GPTModelProvider``.

Plain PyTorch (see ARCHITECTURE.md principle 1): no process groups and no parallel layers. Tensor, sequence,
data and pipeline parallelism are applied from outside by ``longspan.parallel`` as plans over these module
names::

    embedding.word_embeddings                  nn.Embedding [padded_vocab, hidden]
    embedding.position_embeddings              nn.Embedding [seq_length, hidden] (learned_absolute only)
    decoder.layers.{i}.input_layernorm         LayerNorm / RMSNorm
    decoder.layers.{i}.self_attention.linear_q / linear_k / linear_v / linear_proj   nn.Linear
    decoder.layers.{i}.self_attention.q_layernorm / k_layernorm                       (qk_layernorm only)
    decoder.layers.{i}.self_attention.linear_q_proj or linear_q_down_proj + q_layernorm + linear_q_up_proj,
        linear_kv_down_proj, kv_layernorm, linear_kv_up_proj, linear_proj   (multi_latent_attention: models/mla.py)
    decoder.layers.{i}.self_attention.linear_gate                                    (attention_output_gate only)
    decoder.layers.{i}.self_attention.linear_q / linear_k / linear_v / linear_z / linear_b / linear_a,
        conv_q / conv_k / conv_v, dt_bias, A_log, norm, linear_proj
                                  (gated DeltaNet layers, linear_attention_freq: models/gated_delta_net.py)
    decoder.layers.{i}.pre_mlp_layernorm
    decoder.layers.{i}.mlp.linear_fc1 (up), linear_fc1_gate (gated only), linear_fc2 (down)
    decoder.layers.{i}.mlp.router / experts / shared_experts   (MoE layers: see longspan.models.moe)
    decoder.final_layernorm                    (post_process only)
    mtp.layers.{k}.enorm / hnorm / eh_proj / transformer_layer.* / final_layernorm
                                               (mtp_num_layers, post_process only: see longspan.models.mtp)
    output_layer                               nn.Linear [padded_vocab, hidden], bias-free (absent when tied)
    tied_output                                parameter-free: logits = hidden @ word_embeddings.weight^T
                                               (present only when tied on a stage with the embedding)

``{i}`` is the global layer index. Pipeline stages: ``pre_process`` keeps the embedding, ``post_process`` the
final norm, output layer and loss. A stage without ``pre_process`` takes hidden states ``[b, s, hidden]`` as its
first positional argument (what ``torch.distributed.pipelining`` passes on) or as ``hidden_states=``; a stage
without ``post_process`` returns hidden states.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from longspan.core.logging import get_logger, print_rank_0
from longspan.core.model_parallel_config import ModelParallelConfig
from longspan.models.args import TransformerArgs, padded_vocab_size  # noqa: F401 (padded_vocab_size: imported from here)
from longspan.models.init import init_weights, materialize_model  # noqa: F401 (init_weights: imported from here)
from longspan.models.loss import LogitsWorkspace, fused_linear_cross_entropy, linear_cross_entropy
from longspan.models.mtp import MultiTokenPredictionBlock
from longspan.models.rope import LinearScaledRotaryEmbedding, RotaryEmbedding
from longspan.models.transformer import KVCache, LocalGlobalRotary, TransformerBlock

if TYPE_CHECKING:  # the provider imports this module to build its model
    from longspan.models.gpt_provider import GPTModelProvider
    from longspan.models.mamba_provider import MambaProvider

_log = get_logger(__name__)


def resolve_model_args(config: GPTModelProvider) -> TransformerArgs:
    """Check ``config`` (the model rules of ``longspan.config.rules.model``) and return the typed arguments the
    modules read, with Megatron's derived defaults filled in. The provider itself is not modified."""
    return TransformerArgs.from_config(config)


class LanguageModelEmbedding(nn.Module):
    """Word embeddings (+ learned absolute position embeddings), then embedding dropout (hidden_dropout)."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        dtype = args.params_dtype
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        self.word_embeddings.init_std = args.embedding_init_method_std
        if args.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(args.seq_length, args.hidden_size, dtype=dtype)
            self.position_embeddings.init_std = args.embedding_init_method_std
        else:
            self.position_embeddings = None
        self.embedding_dropout = nn.Dropout(args.hidden_dropout)
        # Gemma: sqrt(hidden), as a float32 number rounded to the embeddings' dtype (HF's embed_scale)
        self.embedding_scale = args.hidden_size**0.5 if args.apply_embedding_scaling else None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids)
        if self.embedding_scale is not None:
            scale = torch.tensor(self.embedding_scale, dtype=torch.float32, device=embeddings.device)
            embeddings = embeddings * scale.to(embeddings.dtype)
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids)
        return self.embedding_dropout(embeddings)


class TiedOutputProjection(nn.Module):
    """The logits of a model whose output layer is its word embeddings: ``hidden @ weight^T``.

    Parameter-free (the embedding's weight is passed in, so the two uses share one tensor); a module rather than
    a bare ``F.linear`` so that parallel plans can lay out its input and output as they do the output layer's.
    """

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, weight)


class DecoderLanguageModel(nn.Module):
    """What the decoder-only language models (``GPTModel``, ``longspan.models.mamba.MambaModel``) share around
    their layer stack: the embedding (first pipeline stage), the rotary table, the output layer and loss (last
    stage), and the forward contract. A subclass calls ``super().__init__`` with its resolved args, then sets
    ``self.decoder`` (called as ``decoder(hidden_states, rotary, attention_mask, kv_cache=...)``) and
    ``self.output_layer = self.build_output_layer()``, in that order (the modules' registration order)."""

    # A model with a chunked linear + cross-entropy here uses it for the loss when cross_entropy_loss_fusion is
    # set; None keeps the plain output layer + cross-entropy.
    linear_cross_entropy = None

    def __init__(self, config: GPTModelProvider | MambaProvider, args: TransformerArgs, pre_process: bool,
                 post_process: bool, vp_stage: int | None) -> None:
        super().__init__()
        self.config = config
        self.args = args
        self.pre_process = pre_process
        self.post_process = post_process
        self.vp_stage = vp_stage
        self.vocab_size = args.vocab_size
        self.share_embeddings_and_output_weights = args.share_embeddings_and_output_weights
        self.fp16_lm_cross_entropy = args.fp16_lm_cross_entropy
        self.embedding = LanguageModelEmbedding(args) if pre_process else None
        tied_here = args.share_embeddings_and_output_weights and pre_process and post_process
        self.tied_output = TiedOutputProjection() if tied_here else None
        # the training loss's reused [tokens, vocab] buffers (longspan.models.loss.LogitsWorkspace; CPU only)
        self.logits_workspace = LogitsWorkspace()
        self.rotary_pos_emb, self.local_rotary_pos_emb = _rotary_embeddings(args)
        # multi-token prediction (longspan.models.mtp) on the last stage, when a subclass builds it (registered
        # then, after the output layer)
        self.mtp: nn.Module | None = None

    def build_output_layer(self) -> nn.Linear | None:
        """The output layer of a last stage, or None (not the last stage, or tied to this stage's embedding)."""
        args = self.args
        if not self.post_process or (self.share_embeddings_and_output_weights and self.pre_process):
            return None
        output_layer = nn.Linear(args.hidden_size, self.vocab_size, bias=False, dtype=args.params_dtype)
        output_layer.init_std = args.init_method_std
        if self.share_embeddings_and_output_weights:
            # Tied weights on a last stage without the embedding: a separate copy that starts equal to the
            # word embeddings (same init stream and std); keeping the two in sync is the pipeline layer's job.
            output_layer.init_std = args.embedding_init_method_std
            output_layer.init_name_overrides = {"weight": "embedding.word_embeddings.weight"}
        return output_layer

    def output_weight(self) -> torch.Tensor:
        """The output projection's weight: ``output_layer.weight``, or the word embeddings when tied."""
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def _fused_loss_applies(self) -> bool:
        # A wrapped or replaced output layer (an adapter, float8) must run as a module: keep the plain path.
        return self.output_layer is None or type(self.output_layer) is nn.Linear

    def _grad_in_forward_loss_applies(self, hidden_states: torch.Tensor) -> bool:
        """Whether the training loss may come from ``fused_linear_cross_entropy`` (the plain path's maths with
        the logits' gradient formed in the forward): a training forward on plain float32 tensors (no DTensor
        from tensor/sequence parallel, no autocast, no fp16 loss), with an output layer no hook, adapter or
        wrapper needs to see run as a module."""
        if not torch.is_grad_enabled() or self.fp16_lm_cross_entropy or not self._fused_loss_applies():
            return False
        weight = self.output_weight()
        if not (hidden_states.requires_grad or weight.requires_grad):
            return False
        if type(hidden_states) is not torch.Tensor or type(weight) not in (torch.Tensor, nn.Parameter):
            return False
        if hidden_states.dtype != torch.float32 or weight.dtype != torch.float32:
            return False
        device_type = "cpu" if hidden_states.device.type == "meta" else hidden_states.device.type  # meta: `plan`
        if torch.is_autocast_enabled(device_type):
            return False
        layer = self.output_layer if self.output_layer is not None else self.tied_output
        if layer is not None and (layer._forward_hooks or layer._forward_pre_hooks):
            return False
        return not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        hidden_states: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        loss_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
        decoder_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the model (or this pipeline stage).

        Args:
            input_ids: token ids ``[b, s]``; on a stage without ``pre_process``, the previous stage's hidden
                states ``[b, s, hidden]`` (unless passed as ``hidden_states``).
            position_ids: ``[b, s]`` or ``[1, s]``; ``None`` means ``arange(s)``. They drive RoPE and learned
                position embeddings (so reset position ids work).
            attention_mask: Megatron's convention, bool with True = masked, ``[b or 1, 1, s, s]``; ``None`` means
                causal (SDPA's ``is_causal`` fast path).
            labels: ``[b, s]`` target ids; when given, the last stage returns the per-token loss.
            hidden_states: the input of a non-first stage, by keyword.
            kv_cache: incremental decoding (``longspan.inference``): the keys and values of the tokens before
                ``input_ids`` are read from it and the new ones appended. Default positions continue from
                ``kv_cache.seq_len`` and a ``None`` mask means causal over cached + new tokens.
            loss_mask: ``[b, s]``, read only by multi-token prediction (its shifted masks; None = all ones).
            cu_seqlens: packed documents' boundaries ``[b, n]`` or ``[n]`` (each document's first position, then
                the end), read by multi-token prediction (no shifted token crosses a document) and by gated
                DeltaNet layers (their state restarts at every document).
            token_ids: the microbatch's token ids on a stage without ``pre_process`` (its first input is hidden
                states), read only by multi-token prediction.
            decoder_input: the first stage's input embeddings ``[b, s, hidden]``, computed by the caller instead
                of the embedding lookup (a vision-language model's token embeddings with its image embeddings
                put in); ``input_ids`` still gives the shape and multi-token prediction's tokens.

        Returns:
            last stage: logits ``[b, s, padded_vocab]`` without labels; float32 per-token cross-entropy
            ``[b, s]`` (unreduced) with labels. Other stages: hidden states ``[b, s, hidden]``.
        """
        if self.pre_process:
            seq_len = input_ids.shape[1]
            device = input_ids.device
        else:
            if hidden_states is None:
                hidden_states = input_ids
            seq_len = hidden_states.shape[1]
            device = hidden_states.device
        past = kv_cache.seq_len if kv_cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + seq_len, device=device).unsqueeze(0)
        if kv_cache is not None and attention_mask is None and past > 0:
            # SDPA's is_causal aligns the mask top-left, which is wrong when queries start after cached keys.
            attention_mask = kv_cache.causal_mask(seq_len, device)
        if self.pre_process:
            hidden_states = self.embedding(input_ids, position_ids) if decoder_input is None else decoder_input
        rotary = self.rotary_pos_emb(position_ids) if self.rotary_pos_emb is not None else None
        if self.local_rotary_pos_emb is not None:
            rotary = LocalGlobalRotary(global_tables=rotary, local_tables=self.local_rotary_pos_emb(position_ids))
        # only a decoder with gated DeltaNet layers takes the documents' boundaries (attention reads the mask)
        documents = {"cu_seqlens": cu_seqlens} if self.args.gated_delta_net is not None else {}
        hidden_states = self.decoder(hidden_states, rotary, attention_mask, kv_cache=kv_cache, **documents)
        if kv_cache is not None:
            kv_cache.seq_len += seq_len
        if not self.post_process:
            return hidden_states
        if self.mtp is not None and labels is not None:
            # the MTP loss joins the gradients through the main head's input; the return stays the main loss
            mtp_ids = input_ids if self.pre_process else token_ids
            if mtp_ids is None:
                raise ValueError("multi-token prediction on a stage after the first needs token_ids=")
            hidden_states = self.mtp(
                hidden_states, input_ids=mtp_ids, position_ids=position_ids, labels=labels, loss_mask=loss_mask,
                embed=self.embedding, per_token_loss=self._output_loss, rotary=rotary,
                attention_mask=attention_mask, cu_seqlens=cu_seqlens,
            )
        if labels is None:
            if self.args.final_logit_softcapping:
                return self._softcapped_output(hidden_states, None)
            return self._logits(hidden_states)
        return self._output_loss(hidden_states, labels)

    def _output_loss(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The float32 per-token cross-entropy ``[b, s]`` of the output layer on ``hidden_states``."""
        if self.args.final_logit_softcapping:  # the loss needs the capped logits: no fused loss path
            return self._softcapped_output(hidden_states, labels)
        if (
            self.linear_cross_entropy is not None
            and self.args.cross_entropy_loss_fusion
            and self._fused_loss_applies()
        ):
            return self.linear_cross_entropy(hidden_states, self.output_weight(), labels)
        if self._grad_in_forward_loss_applies(hidden_states):
            return fused_linear_cross_entropy(hidden_states, self.output_weight(), labels, self.logits_workspace)
        return self._per_token_loss(self._logits(hidden_states), labels)

    def _logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.output_layer is not None:
            # Called as a module (not F.linear on its weight) so tensor-parallel plans' hooks on it run.
            return self.output_layer(hidden_states)
        return self.tied_output(hidden_states, self.embedding.word_embeddings.weight)

    def _softcapped_output(self, hidden_states: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Logits (or the per-token loss on them) with Gemma 2's final soft-cap, ``cap * tanh(logits / cap)``."""
        cap = self.args.final_logit_softcapping
        logits = torch.tanh(self._logits(hidden_states) / cap) * cap
        return logits if labels is None else self._per_token_loss(logits, labels)

    def _per_token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Float32 logits (unless fp16_lm_cross_entropy) and reduction='none', on [b*s, vocab], keep this torch's
        # loss_parallel-compatible under tensor parallel (vocab-sharded logits, no full-vocab gather).
        flat = logits.flatten(0, 1)
        if self.fp16_lm_cross_entropy:
            # Megatron computes this loss in fp16; autocast would promote cross_entropy to fp32, so it is off here.
            with torch.autocast(device_type=flat.device.type, enabled=False):
                loss = F.cross_entropy(flat.half(), labels.flatten(0, 1), reduction="none")
        else:
            loss = F.cross_entropy(flat.float(), labels.flatten(0, 1), reduction="none")
        return loss.float().view(labels.shape)


def _rotary_embeddings(args: TransformerArgs) -> tuple[RotaryEmbedding | None, RotaryEmbedding | None]:
    """The rotary table(s): (global, local). The local one exists only with a ``[local, global]`` rotary_base;
    then the global one carries the linear scaling (``global_rope_linear_factor``) and the local one none."""
    if args.position_embedding_type != "rope":
        return None, None
    common = dict(rotary_percent=args.rotary_percent, seq_len_interpolation_factor=args.seq_len_interpolation_factor)
    if args.rotary_base_local is not None:
        global_table = LinearScaledRotaryEmbedding(args.kv_channels, args.global_rope_linear_factor,
                                                   rotary_base=args.rotary_base, **common)
        return global_table, RotaryEmbedding(args.kv_channels, rotary_base=args.rotary_base_local, **common)
    global_table = RotaryEmbedding.from_args(args)
    return global_table, None


class GPTModel(DecoderLanguageModel):
    """Decoder-only transformer (Megatron Core's GPTModel in plain PyTorch); the embedding, output layer and
    forward are ``DecoderLanguageModel``'s, the layers a ``TransformerBlock``.

    Args:
        config: a ``GPTModelProvider``.
        pre_process: build the embedding (first pipeline stage).
        post_process: build the final norm, output layer and loss (last pipeline stage).
        vp_stage: virtual pipeline stage index, recorded for the pipeline layer.
        layer_numbers: global indices of the layers to build (default: all); the pipeline layer may pass a
            stage's range here, or build all on the meta device and delete entries of ``decoder.layers``.
    """

    def __init__(
        self,
        config: GPTModelProvider,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
        layer_numbers: list[int] | None = None,
    ) -> None:
        super().__init__(config, resolve_model_args(config), pre_process, post_process, vp_stage)
        self.position_embedding_type = self.args.position_embedding_type
        # cross_entropy_loss_fusion: the loss with labels comes from this chunked linear + cross-entropy
        # (longspan.models.loss), never materialising [b, s, vocab] logits; the tp plan swaps in its
        # vocab-parallel form.
        self.linear_cross_entropy = linear_cross_entropy
        self.decoder = TransformerBlock(self.args, layer_numbers=layer_numbers, post_process=post_process)
        self.output_layer = self.build_output_layer()
        if self.args.mtp_num_layers and post_process:
            if not pre_process:
                # the depths embed shifted token ids: a last stage keeps its own copy of the embedding, kept
                # equal to the first stage's by the pipeline layer (megatron-core's MTP embedding tie)
                self.embedding = LanguageModelEmbedding(self.args)
            self.mtp = MultiTokenPredictionBlock(self.args)


def build_gpt_model(
    provider: GPTModelProvider,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    *,
    seed: int | None = None,
    materialize: bool = True,
    device: torch.device | str | None = None,
    layer_numbers: list[int] | None = None,
) -> GPTModel:
    """Build a ``GPTModel`` on the meta device and (by default) materialize and initialize it.

    Args:
        provider: a ``GPTModelProvider``.
        pre_process, post_process, vp_stage, layer_numbers: see ``GPTModel``.
        seed: the init seed; default ``torch.initial_seed()``. Pass the run's base seed (not the per-pipeline-rank
            one) so every layout draws the same weights.
        materialize: False returns the model on the meta device, for parallel plans to be applied first;
            then call ``init_weights(model, seed)``.
        device: where to materialize; default the current default device (the CPU when
            ``use_cpu_initialization``).

    With ``perform_initialization=False`` parameters are materialized but not drawn (contents undefined; load
    a checkpoint into them), as in Megatron.
    """
    with torch.device("meta"):
        model = GPTModel(provider, pre_process, post_process, vp_stage, layer_numbers=layer_numbers)
    return materialize_model(model, provider, seed, device) if materialize else model


def num_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Number of parameters (tied ones counted once; DTensors by their full size).

    With ``exclude_embeddings`` the word and position embeddings are left out (and a tied output layer with
    them, as it is the same tensor); an untied ``output_layer`` still counts, as in Megatron's report.
    """
    total = 0
    for name, param in model.named_parameters():  # named_parameters() yields shared tensors once
        parts = name.split(".")
        if exclude_embeddings and ("word_embeddings" in parts or "position_embeddings" in parts):
            continue
        total += param.numel()
    return total


def apply_deterministic_mode(provider: ModelParallelConfig) -> None:
    """With ``provider.deterministic_mode``, turn on torch's deterministic algorithms (for the trainer to call).

    On CUDA, cuBLAS also needs ``CUBLAS_WORKSPACE_CONFIG``; it is set to ``:4096:8`` unless already set.
    """
    if not provider.deterministic_mode:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    print_rank_0("deterministic_mode: torch deterministic algorithms enabled", _log)
