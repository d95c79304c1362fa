"""One gated DeltaNet layer vs full causal attention of the same width vs transformers' own torch implementation:
forward+backward microseconds per token at 2k-32k tokens, on CPU.

    PYTHONPATH=. python benchmarks/bench_gated_deltanet.py [--lengths 2048 4096 8192 16384 32768] [--hidden 256]
        [--repeats 2] [--threads N]

One mixer each, batch 1, fp32, the input ``[1, s, hidden]`` and the sum of the output as the loss (a backward
through every parameter and the input):

- ``deltanet``: longspan's ``GatedDeltaNet`` (``longspan.models.gated_delta_net``: q/k/v/z/b/a projections,
  causal conv, the chunked WY gated delta rule with chunks of 64, gated norm, output projection), Qwen3.5's shape
  scaled to the width: key heads of 128 (hidden / 128 of them), twice as many value heads of 128, conv of 4;
- ``hf``: transformers' ``Qwen3_5GatedDeltaNet`` of the same sizes, on its torch fallbacks
  (``torch_chunk_gated_delta_rule``, the conv fallback), as it runs without flash-linear-attention;
- ``attention``: longspan's ``SelfAttention`` with heads of 128 (hidden / 128 of them, no grouping), RoPE,
  causal SDPA (its CPU flash kernel), with the attention output gate as Qwen3.5's full-attention layers have.

Reported per length: median microseconds per token over ``--repeats`` runs after one warm-up, and the ratios.
The delta rule's cost per token stays flat as the sequence grows (only the chunk-to-chunk state is sequential);
attention's grows with the length (its score matrix is quadratic). The machine's load average is printed before
and after: on a shared machine the absolute numbers move with it, the ratios much less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from longspan.models.gpt import build_gpt_model  # noqa: E402
from longspan.models.gpt_provider import GPTModelProvider  # noqa: E402

HEAD_DIM = 128
CHUNK = 64


def longspan_mixers(hidden: int) -> tuple[torch.nn.Module, torch.nn.Module, Callable]:
    """(DeltaNet mixer, attention module, the attention's rotary tables for a length) of a 2-layer hybrid."""
    heads = hidden // HEAD_DIM
    provider = GPTModelProvider(
        num_layers=2, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=heads, kv_channels=HEAD_DIM,
        vocab_size=128, make_vocab_size_divisible_by=1, seq_length=32768,
        position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, experimental_attention_variant="gated_delta_net", linear_attention_freq=[1, 0],
        linear_conv_kernel_dim=4, linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM,
        linear_num_key_heads=heads, linear_num_value_heads=2 * heads, attention_output_gate=True,
    )
    provider.finalize()
    model = build_gpt_model(provider, seed=0)
    deltanet = model.decoder.layers["0"].self_attention
    attention = model.decoder.layers["1"].self_attention
    assert deltanet.chunk_size == CHUNK

    def rotary(length: int):
        return model.rotary_pos_emb(torch.arange(length)[None])

    return deltanet, attention, rotary


def hf_mixer(hidden: int) -> torch.nn.Module:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    heads = hidden // HEAD_DIM
    config = qwen3_5.Qwen3_5TextConfig(
        hidden_size=hidden, linear_num_key_heads=heads, linear_num_value_heads=2 * heads,
        linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM, linear_conv_kernel_dim=4,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
        layer_types=["linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    return qwen3_5.Qwen3_5GatedDeltaNet(config, layer_idx=0)


def time_per_token(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeats: int) -> float:
    """Median microseconds per token of forward + backward (after one warm-up)."""

    def step() -> None:
        inp = x.detach().requires_grad_()
        run(inp).sum().backward()

    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6 / x.shape[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    deltanet, attention, rotary = longspan_mixers(args.hidden)
    hf = hf_mixer(args.hidden)
    heads = args.hidden // HEAD_DIM
    print(f"# forward+backward, batch 1, fp32, CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads), "
          f"torch {torch.__version__}; hidden {args.hidden}: DeltaNet {heads} key / {2 * heads} value heads of "
          f"{HEAD_DIM}, attention {heads} heads of {HEAD_DIM}")
    print(f"# load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"{'tokens':>7} | {'deltanet us/tok':>15} | {'hf torch us/tok':>15} | {'attention us/tok':>16} | "
          f"{'hf/deltanet':>11} | {'attention/deltanet':>18}")
    for length in args.lengths:
        torch.manual_seed(0)
        x = torch.randn(1, length, args.hidden) * 0.5
        tables = rotary(length)
        t_delta = time_per_token(lambda h: deltanet(h), x, args.repeats)
        t_hf = time_per_token(lambda h: hf(h), x, args.repeats)
        t_attn = time_per_token(lambda h: attention(h, tables, None), x, args.repeats)
        print(f"{length:>7} | {t_delta:>15.1f} | {t_hf:>15.1f} | {t_attn:>16.1f} | {t_hf / t_delta:>11.2f} | "
              f"{t_attn / t_delta:>18.2f}", flush=True)
    print(f"# load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
