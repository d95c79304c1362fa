"""HF conversion benchmark: import/export time and peak memory for a ~1B-parameter Llama (random bf16 weights).

The model is written directly as safetensors shards with torch + safetensors (no HF model is built), with a
config.json of ``LlamaForCausalLM`` (hidden 2048, 18 layers, 16 heads / 8 kv groups, SwiGLU 5632, vocab 32000,
untied: ~0.98B parameters, ~2 GB in bf16). Then, each in a fresh process tree:

- ``longspan convert import`` (HF -> longspan checkpoint) and ``convert export`` (checkpoint -> HF), on one
  process and with ``--nproc-per-node 2`` (``model.tensor_model_parallel_size=2`` by default, or FSDP2 with
  ``--layout fsdp2``);
- the reference tool: transformers ``AutoModelForCausalLM.from_pretrained(dtype=bfloat16)`` then
  ``save_pretrained`` (one process).

Reported per step: wall time, the peak RSS of the largest process (``getrusage`` of the waited-for process
tree) and the peak of the summed RSS of the whole tree (sampled from /proc every 0.1 s). The exported
tensors are checked bit-identical to the source.

Run: ``python benchmarks/bench_hf_conversion.py [--workdir DIR] [--layers 18] [--layout tp2|fsdp2] [--keep]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_llama(directory: Path, layers: int, hidden: int = 2048, ffn: int = 5632, heads: int = 16, kv: int = 8,
                vocab: int = 32000, shard_bytes: int = 1 << 30) -> int:
    """Random bf16 Llama safetensors shards + index + config.json; returns the parameter count."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
                   (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
                   (p + "self_attn.k_proj.weight", (kv * head_dim, hidden)),
                   (p + "self_attn.v_proj.weight", (kv * head_dim, hidden)),
                   (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
                   (p + "mlp.gate_proj.weight", (ffn, hidden)), (p + "mlp.up_proj.weight", (ffn, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, ffn))]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = 0
    for name, shape in shapes:
        t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        nbytes = t.numel() * 2
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += t.numel()
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total * 2}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
              "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
              "attention_bias": False, "mlp_bias": False, "dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return total


def _tree_rss(pid: int) -> int:
    """Summed RSS (bytes) of ``pid`` and its descendants."""
    total = 0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            with open(f"/proc/{p}/task/{p}/children") as fh:
                stack.extend(int(c) for c in fh.read().split())
        except (OSError, ValueError):
            pass
    return total


def measure(cmd: list[str], label: str) -> dict:
    """Run ``cmd``; wall time, peak RSS of the largest process, peak summed RSS of the tree."""
    # A thin wrapper reports the largest RSS among its own waited-for descendants (fresh for each step).
    wrapper = [sys.executable, "-c", "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
               "print('BENCH_MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"]
    start = time.time()
    proc = subprocess.Popen(wrapper + cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.1)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, _ = proc.communicate()
    done.set()
    thread.join()
    wall = time.time() - start
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed (exit {proc.returncode}):\n{out[-4000:]}")
    largest = max(int(line.split()[1]) for line in out.splitlines() if line.startswith("BENCH_MAXRSS_KB")) * 1024
    return {"step": label, "wall_s": wall, "largest_rss_gib": largest / 2**30, "tree_rss_gib": peak[0] / 2**30,
            "note": ""}


def reference_script(src: Path, dst: Path) -> list[str]:
    code = (
        "import torch, transformers, sys\n"
        f"m = transformers.AutoModelForCausalLM.from_pretrained({str(src)!r}, dtype=torch.bfloat16)\n"
        f"m.save_pretrained({str(dst)!r})\n"
    )
    return [sys.executable, "-c", code]


def same_tensors(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    def names(d: Path) -> dict[str, Path]:
        out = {}
        for f in d.glob("*.safetensors"):
            with safe_open(str(f), "pt") as fh:
                out.update({k: f for k in fh.keys()})
        return out

    na, nb = names(a), names(b)
    if sorted(na) != sorted(nb):
        return False
    for name in na:
        with safe_open(str(na[name]), "pt") as fa, safe_open(str(nb[name]), "pt") as fb:
            if not torch.equal(fa.get_tensor(name), fb.get_tensor(name)):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--layers", type=int, default=18, help="decoder layers (18: ~0.98B parameters)")
    parser.add_argument("--layout", choices=("tp2", "fsdp2"), default="tp2", help="layout of the 2-process runs")
    parser.add_argument("--skip-reference", action="store_true", help="do not run transformers")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_hf_"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "hf"
    t0 = time.time()
    params = write_llama(src, args.layers)
    print(f"wrote a {params / 1e9:.2f}B-parameter bf16 Llama to {src} in {time.time() - t0:.1f}s", flush=True)
    layout = (["model.tensor_model_parallel_size=2"] if args.layout == "tp2" else ["dist.use_torch_fsdp2=true"])
    cli = [sys.executable, "-m", "longspan", "convert"]
    rows = []
    try:
        for nproc in (1, 2):
            ckpt, out = work / f"ckpt{nproc}", work / f"out{nproc}"
            extra = ["--nproc-per-node", "2", *layout] if nproc == 2 else []
            tag = "1 process" if nproc == 1 else f"2 processes ({args.layout})"
            rows.append(measure(cli + ["import", "--hf-model", str(src), "--output", str(ckpt), "--no-progress",
                                       *extra], f"longspan import, {tag}"))
            print(rows[-1], flush=True)
            rows.append(measure(cli + ["export", "--checkpoint", str(ckpt), "--output", str(out), "--no-progress",
                                       *extra], f"longspan export, {tag}"))
            print(rows[-1], flush=True)
            rows[-1]["note"] += " [bit-identical]" if same_tensors(src, out) else " [DIFFERS]"
            shutil.rmtree(ckpt)
            shutil.rmtree(out)
        if not args.skip_reference:
            ref = work / "ref"
            rows.append(measure(reference_script(src, ref), "transformers from_pretrained + save_pretrained"))
            shutil.rmtree(ref, ignore_errors=True)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{params / 1e9:.2f}B-parameter Llama, bf16 ({params * 2 / 2**30:.2f} GiB of weights), CPU\n")
    print(f"| step | wall (s) | peak RSS, largest process (GiB) | peak RSS, all processes (GiB) | note |")
    print("| --- | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['step']} | {r['wall_s']:.1f} | {r['largest_rss_gib']:.2f} | {r['tree_rss_gib']:.2f} | {r['note']} |")


if __name__ == "__main__":
    main()
