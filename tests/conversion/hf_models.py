"""Tiny random HF models of every supported family, saved with ``save_pretrained`` (test oracles)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

VOCAB = 96  # not a multiple of 128: the provider's divisor keeps it unpadded
FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen3_moe")
MOE_FAMILIES = ("mixtral", "qwen3_moe")
#: families whose HF models are not ``AutoModelForCausalLM`` decoders of FAMILIES' shape (own config fields)
MAMBA_FAMILIES = ("mamba2", "nemotron_h")
SEQ2SEQ_FAMILIES = ("t5",)
#: one of each supported HF architecture
EVERY_ARCHITECTURE = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen3_moe", *MAMBA_FAMILIES,
                      *SEQ2SEQ_FAMILIES)


def _other_config(family: str):
    if family == "mamba2":
        return transformers.Mamba2Config(num_heads=8, head_dim=8, vocab_size=VOCAB, hidden_size=32, state_size=8,
                                         num_hidden_layers=3, n_groups=2, expand=2, chunk_size=8, conv_kernel=4)
    if family == "nemotron_h":
        return transformers.NemotronHConfig(
            vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"],
            intermediate_size=48, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=8,
            conv_kernel=4)
    if family == "t5":
        return transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=12, d_ff=48, num_layers=2,
                                     num_decoder_layers=3, num_heads=4, relative_attention_num_buckets=8,
                                     relative_attention_max_distance=12, dropout_rate=0.0, decoder_start_token_id=0)
    raise ValueError(family)


def hf_config(family: str, **overrides):
    if family in MAMBA_FAMILIES or family in SEQ2SEQ_FAMILIES:
        cfg = _other_config(family)
        for key, value in overrides.items():
            setattr(cfg, key, value)
        return cfg
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False, attention_dropout=0.0)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, rope_parameters=rope)
    elif family == "llama3":
        rope3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        cfg = transformers.LlamaConfig(**dict(common, tie_word_embeddings=True), rope_parameters=rope3)
    elif family == "mistral":
        cfg = transformers.MistralConfig(**common, rope_parameters=rope, sliding_window=None)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**dict(common, tie_word_embeddings=True), head_dim=12, rope_parameters=rope,
                                       use_sliding_window=False)
    elif family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                                      activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(**common, rope_parameters=rope, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=None)
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**dict(common, num_hidden_layers=3), rope_parameters=rope, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
                                          norm_topk_prob=False, use_sliding_window=False)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def make_hf_model(family: str, directory, dtype=torch.float32, max_shard_size=None, tokenizer: bool = True,
                  seed: int = 0, **overrides):
    """Save a random ``family`` model (non-trivial norms and biases) to ``directory``; returns the model."""
    cfg = hf_config(family, **overrides)
    torch.manual_seed(seed)
    if family in SEQ2SEQ_FAMILIES:
        model = transformers.AutoModelForSeq2SeqLM.from_config(cfg)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if family in MAMBA_FAMILIES or family in SEQ2SEQ_FAMILIES:  # constants (norms, D, dt bias) made distinct
                p.add_(torch.randn_like(p) * 0.02)
                continue
            if "norm" in name or name.endswith("bias") or "ln_" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0, 0.2)
            if "gate.weight" in name:  # routers: spread the routing so ties never happen
                p.normal_(0, 1.0)
    model = model.to(dtype).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    if tokenizer:
        make_tokenizer(directory)
    return model


def make_tokenizer(directory) -> None:
    """A tiny BPE tokenizer (vocab <= VOCAB) saved as a PreTrainedTokenizerFast."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # sorted: alphabet() comes from a hash set whose order changes from process to process, and a different
    # first 60 made a different tokenizer (and different test data) in every process
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=["<unk>", "<eos>", "<pad>"],
                                  initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet())[:60])
    text = ["def hello(world): return world + 1", "the quick brown fox jumps over the lazy dog"] * 20
    tok.train_from_iterator(text, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                                pad_token="<pad>")
    fast.save_pretrained(str(directory))


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return model(input_ids=tokens).logits


def read_config(directory) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())
