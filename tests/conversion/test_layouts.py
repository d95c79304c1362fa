"""Import and export under TP2, PP2, DP2 with FSDP2 and EP2: the same logits and the same HF tensors, bit for
bit, as one process (pool2 workers, fp32 CPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tests.conversion.hf_models import VOCAB, make_hf_model


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _import_forward_export(hf_dir: str, layout: dict, fsdp: bool, tokens, save_dir: str):
    """On every rank: import for ``layout``, logits on ``tokens`` (last stage), the exported HF tensors."""
    import torch.distributed as dist

    from longspan.conversion import safetensors_io
    from longspan.conversion.bridge import AutoBridge, container_for
    from longspan.parallel.init import initialize_distributed
    from longspan.parallel.parallelize import parallel_loss_context

    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = bridge.to_megatron_provider()
    for key, value in layout.items():
        setattr(provider, key, value)
    cfg = container_for(provider)
    cfg.dist.use_torch_fsdp2 = fsdp
    initialize_distributed(cfg.dist, provider, device="cpu")
    read_elements = []
    original_read = safetensors_io.HFCheckpointReader.read

    def counting_read(self, name, box=None):
        out = original_read(self, name, box)
        read_elements.append(out.numel())
        return out

    safetensors_io.HFCheckpointReader.read = counting_read
    try:
        chunks = bridge.to_megatron_model(cfg=cfg)
    finally:
        safetensors_io.HFCheckpointReader.read = original_read
    for chunk in chunks:
        chunk.eval()
    logits = None
    with torch.no_grad():
        if layout.get("pipeline_model_parallel_size", 1) > 1:
            if dist.get_rank() == 0:
                dist.send(chunks[0](tokens).contiguous(), 1)
            else:
                hidden = torch.empty(tokens.shape + (provider.hidden_size,))
                dist.recv(hidden, 0)
                logits = chunks[0](hidden)
        else:
            with parallel_loss_context(chunks[0]):
                logits = _full(chunks[0](tokens))
    exported = {name: t.clone() for name, t in bridge.export_hf_weights(chunks)}
    bridge.save_hf_pretrained(chunks, save_dir, max_shard_size=20_000)  # every stage's writer, several shards
    params = {type(p).__name__ for c in chunks for p in c.parameters()}
    return logits, exported, params, sum(read_elements)


def _one_process(hf_dir, tokens):
    from longspan import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    model = bridge.to_megatron_model()
    with torch.no_grad():
        logits = model[0].eval()(tokens)
    return logits, dict(bridge.export_hf_weights(model))


def _original(hf_dir) -> dict:
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


LAYOUTS = [
    ("llama", {"tensor_model_parallel_size": 2}, False),
    ("gpt2-untied", {"tensor_model_parallel_size": 2}, False),  # GPT-2 with its output layer untied, under TP
    ("llama", {"pipeline_model_parallel_size": 2}, False),
    ("qwen3", {"pipeline_model_parallel_size": 2}, False),  # tied embeddings across stages
    ("qwen2", {}, True),  # data parallel 2 with FSDP2
    ("mixtral", {"expert_model_parallel_size": 2}, False),
    ("qwen3_moe", {"expert_model_parallel_size": 2}, True),  # experts over ep, dense weights FSDP2
    # hybrid: each rank reads its heads' rows of the fused Mamba in_proj / conv1d; the export fuses them back
    ("nemotron_h", {"tensor_model_parallel_size": 2}, False),
]


@pytest.mark.parametrize("family,layout,fsdp", LAYOUTS, ids=[f"{f}-{'-'.join(f'{k[:2]}{v}' for k, v in l.items()) or 'fsdp2'}" for f, l, _ in LAYOUTS])
def test_layout_import_matches_one_process_and_export_is_bit_identical(pool2, tmp_path, family, layout, fsdp):
    hf_dir = tmp_path / "hf"
    if family == "gpt2-untied":
        make_hf_model("gpt2", hf_dir, tokenizer=False, tie_word_embeddings=False)
    else:
        make_hf_model(family, hf_dir, tokenizer=False)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    expected, expected_export = _one_process(hf_dir, tokens)
    save_dir = tmp_path / "saved"
    results = pool2.run(_import_forward_export, str(hf_dir), layout, fsdp, tokens, str(save_dir), timeout=180)
    logits = [r[0] for r in results if r[0] is not None]
    assert logits
    for got in logits:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if layout or fsdp:
        assert any("DTensor" in r[2] for r in results) or layout.get("pipeline_model_parallel_size")
    merged = {}
    total = sum(t.numel() for t in _original(hf_dir).values())
    for _, _, _, read in results:  # each rank reads only its own part (replicated norms/router included)
        assert read < 0.8 * total, (read, total)
    for _, exported, _, _ in results:
        for name, tensor in exported.items():
            if name in merged:
                assert torch.equal(merged[name], tensor), name
            merged[name] = tensor
    assert sorted(merged) == sorted(expected_export)
    original = _original(hf_dir)
    for name, tensor in merged.items():
        assert torch.equal(tensor, expected_export[name]) and torch.equal(tensor, original[name]), name
    saved = _original(save_dir)  # save_hf_pretrained: shards of every stage, named and indexed by rank 0
    assert (save_dir / "model.safetensors.index.json").is_file() and (save_dir / "config.json").is_file()
    assert sorted(saved) == sorted(original) and all(torch.equal(saved[k], v) for k, v in original.items())
