"""Text generation from a GPT model: greedy, or top-k / top-p sampling, with a KV cache.

One prompt on one process. The model is a plain ``GPTModel`` (or the one-chunk list that
``load_model_from_checkpoint`` and ``AutoBridge.to_megatron_model`` return); a model split over several
processes (tensor / pipeline parallel, FSDP2) is refused with a one-line error: load it with ``parallel=None``;
or, with ``collective=True`` (training-time sample generations), every rank of a tensor-parallel or FSDP2 model
runs the same greedy decoding.

Each step turns the logits of the last position into the next token: ``temperature == 0`` takes the argmax
(greedy, the same rule as transformers' ``generate(do_sample=False)``); otherwise the logits are divided by the
temperature, cut to the ``top_k`` most likely tokens and then to the smallest set whose probability reaches
``top_p`` (transformers' order), and a token is drawn with a ``torch.Generator`` seeded by ``seed``. Generation
stops after ``max_new_tokens`` tokens or at an end-of-sequence token (kept in ``output_ids``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.transformer import KVCache


@dataclass
class GenerationResult:
    """What ``generate`` produced for one prompt."""

    prompt_ids: list[int]
    """The prompt's token ids."""
    output_ids: list[int]
    """The generated token ids (the prompt excluded; an end-of-sequence token that stopped generation included)."""
    text: str
    """The generated text: ``output_ids`` detokenized, without the end-of-sequence token."""
    finish_reason: str
    """``"eos"`` (an end-of-sequence token was generated) or ``"length"`` (``max_new_tokens`` reached)."""
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)
    """With ``return_logits=True``: the float32 logits ``[vocab]`` each output token was chosen from."""


def check_generation_args(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """Raise a one-line ``ConfigError`` naming the first out-of-range argument."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if not isinstance(temperature, (int, float)) or not temperature >= 0.0 or temperature == float("inf"):
        raise ConfigError(f"temperature={temperature!r} must be a finite number >= 0 (0 means greedy)")
    if not isinstance(top_k, int) or top_k < 0:
        raise ConfigError(f"top_k={top_k!r} must be an integer >= 0 (0 means no top-k cut)")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p={top_p!r} must be in (0, 1] (1 means no top-p cut)")


def _single_model(model: nn.Module | Sequence[nn.Module], collective: bool = False) -> nn.Module:
    """The one plain module to run: a list must hold a single chunk; DDP wrappers are unwrapped. ``collective``:
    sharded parameters are accepted (every rank of the model runs the same decoding)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ConfigError(
                f"generation runs one model chunk on one process, got {len(model)} chunks (pipeline parallel): "
                "load the checkpoint with parallel=None"
            )
        model = model[0]
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    from torch.distributed.tensor import DTensor  # slow to import; already loaded wherever a DTensor exists

    if not collective and any(isinstance(p, DTensor) for p in model.parameters()):
        raise ConfigError(
            "generation runs on one process, but this model's parameters are sharded (tensor parallel / FSDP2): "
            "load the checkpoint with parallel=None"
        )
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise ConfigError("generation needs the whole model, but this is one pipeline stage of it")
    if hasattr(model, "encoder") and hasattr(model, "decoder"):  # longspan.models.t5.T5Model
        raise NotSupportedError(
            f"text generation is not supported yet for encoder-decoder models ({type(model).__name__}): "
            "it runs decoder-only models (GPT, Mamba)"
        )
    return model


def check_model_inputs(net: nn.Module, model_inputs: dict[str, Any], context: str = "generate") -> None:
    """One-line ``NotSupportedError`` (starting with ``context``) when ``net``'s forward does not take every
    key of ``model_inputs`` (images for a text-only model)."""
    if not model_inputs:
        return
    accepted = inspect.signature(net.forward).parameters
    missing = [name for name in model_inputs if name not in accepted]
    if missing:
        kind = "images" if "pixel_values" in missing else ", ".join(missing)
        raise NotSupportedError(
            f"{context}: {type(net).__name__} is a text-only model, it takes no {kind}; give a vision-language "
            "model or drop the images"
        )


def _eos_ids(tokenizer: Any, eos_ids: Sequence[int] | None) -> set[int]:
    if eos_ids is not None:
        return {int(i) for i in eos_ids}
    eos = getattr(tokenizer, "eos", None)
    if eos is None:
        eos = getattr(tokenizer, "eod", None)
    return set() if eos is None else {int(eos)}


def _max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model can number: the learned position table's size (RoPE has no limit)."""
    embedding = getattr(model, "embedding", None)
    table = getattr(embedding, "position_embeddings", None)
    return None if table is None else int(table.num_embeddings)


def _real_vocab_size(model: nn.Module, tokenizer: Any) -> int | None:
    """The model's vocabulary before padding (its provider's ``vocab_size``), else the tokenizer's."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)  # getattr: any nn.Module, HF's too
    return int(size) if size is not None else getattr(tokenizer, "vocab_size", None)


def next_token_logits_processor(
    logits: torch.Tensor, vocab_size: int | None, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Float32 scores ``[vocab]`` to draw from: padding ids removed, then temperature, top-k and top-p applied.

    Removed tokens get ``-inf``. With ``temperature == 0`` only the padding cut applies (greedy takes the argmax).
    """
    scores = logits.float().clone()
    if vocab_size is not None and vocab_size < scores.shape[-1]:
        scores[vocab_size:] = float("-inf")  # the padded vocabulary's rows are not tokens
    if temperature == 0.0:
        return scores
    scores = scores / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the tokens ranked before it already reach top_p (the first token always stays).
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def _choose(scores: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature == 0.0:
        return int(torch.argmax(scores))
    probs = scores.softmax(dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator))


@torch.inference_mode()
def generate(
    model: nn.Module | Sequence[nn.Module],
    tokenizer: Any,
    prompt: str | Sequence[int],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    use_cache: bool = True,
    *,
    eos_ids: Sequence[int] | None = None,
    return_logits: bool = False,
    collective: bool = False,
    model_inputs: dict[str, Any] | None = None,
) -> GenerationResult:
    """Continue ``prompt`` with up to ``max_new_tokens`` tokens.

    Args:
        model: a ``GPTModel`` or a list holding one (weights loaded; run in eval mode, its mode is restored).
        tokenizer: a longspan tokenizer (``tokenize``, ``detokenize``, ``eos``/``eod``, ``vocab_size``).
        prompt: text, or token ids.
        max_new_tokens: the most tokens to generate.
        temperature: 0 for greedy decoding; > 0 samples from ``softmax(logits / temperature)``.
        top_k: sample among the ``top_k`` most likely tokens only (0: all).
        top_p: sample among the most likely tokens whose probabilities sum to ``top_p`` (1: all).
        seed: seeds the sampling generator (same seed, same output); None draws from torch's global generator.
        use_cache: keep keys and values of past tokens (KV cache) instead of re-running the whole sequence
            each step; both give the same tokens, except with dynamic NTK RoPE, whose cached keys keep the
            frequencies of the length they were computed at (as in transformers).
        eos_ids: token ids that end generation; default the tokenizer's EOS (else EOD); ``()`` never stops early.
        return_logits: keep the logits each output token was chosen from (``GenerationResult.logits``).
        collective: the model's parameters are sharded over processes (tensor parallel without sequence
            parallel, FSDP2) and every one of them calls ``generate`` with the same arguments; each step runs the
            whole sequence (no KV cache) and the full logits every rank sees (gathered by the tensor-parallel
            output layer) choose the same tokens. Greedy only (a draw could differ between ranks).
        model_inputs: more keyword arguments of the model's forward for the prompt, e.g. a vision-language
            model's ``pixel_values`` and ``image_grid_thw`` (``longspan.inference.images``); they go with the
            prompt's forward (every forward without the KV cache). A model whose forward does not take them is
            refused with a one-line error.
    """
    check_generation_args(max_new_tokens, temperature, top_k, top_p)
    if collective and temperature != 0.0:
        raise ConfigError(f"collective generation is greedy only, got temperature={temperature!r}")
    net = _single_model(model, collective)
    model_inputs = dict(model_inputs or {})
    check_model_inputs(net, model_inputs)
    use_cache = use_cache and not collective
    prompt_ids = tokenizer.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    if not prompt_ids:
        raise ConfigError("the prompt is empty: give at least one token of text")
    limit = _max_positions(net)
    total = len(prompt_ids) + max_new_tokens
    if limit is not None and total > limit:
        raise ConfigError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
            f"model's {limit} learned positions: shorten the prompt or lower max_new_tokens"
        )
    stop = _eos_ids(tokenizer, eos_ids)
    vocab_size = _real_vocab_size(net, tokenizer)
    device = next(net.parameters()).device
    generator = None
    if seed is not None and temperature > 0.0:
        generator = torch.Generator(device=device)
        generator.manual_seed(int(seed))

    was_training = net.training
    net.eval()
    try:
        output_ids, logits, finish = _decode(
            net, prompt_ids, max_new_tokens, temperature, top_k, top_p, generator, use_cache, stop, vocab_size,
            device, return_logits, model_inputs,
        )
    finally:
        net.train(was_training)
    text_ids = output_ids[:-1] if finish == "eos" else output_ids
    return GenerationResult(prompt_ids, output_ids, tokenizer.detokenize(text_ids), finish, logits)


def _decode(
    net: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
    use_cache: bool,
    stop: set[int],
    vocab_size: int | None,
    device: torch.device,
    return_logits: bool,
    model_inputs: dict[str, Any],
) -> tuple[list[int], list[torch.Tensor], str]:
    """The decoding loop: (output ids, per-step logits if asked, finish reason). ``model_inputs`` go with the
    prompt's forward (with the cache: the first step only)."""
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    cache = KVCache(len(prompt_ids) + max_new_tokens) if use_cache else None
    step_input = tokens
    output_ids: list[int] = []
    kept_logits: list[torch.Tensor] = []
    rotary = getattr(net, "rotary_pos_emb", None)
    for _ in range(max_new_tokens):
        if cache is not None and cache.seq_len and rotary is not None and rotary.reencode_from(
                cache.seq_len, tokens.shape[1]):
            # LongRoPE switches to its long factors for the whole sequence: re-encode it (as transformers' Phi-3)
            cache, step_input = KVCache(len(prompt_ids) + max_new_tokens), tokens
        if cache is not None:
            extra = model_inputs if cache.seq_len == 0 else {}
            last = net(step_input, kv_cache=cache, **extra)[0, -1]
        else:
            last = net(tokens, **model_inputs)[0, -1]
        if return_logits:
            kept_logits.append(last.float().cpu())
        scores = next_token_logits_processor(last, vocab_size, temperature, top_k, top_p)
        token = _choose(scores, temperature, generator)
        output_ids.append(token)
        if token in stop:
            return output_ids, kept_logits, "eos"
        step_input = torch.tensor([[token]], dtype=torch.long, device=device)
        tokens = torch.cat([tokens, step_input], dim=1)
    return output_ids, kept_logits, "length"
