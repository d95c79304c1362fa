"""Multi-latent attention under the layouts: TP2+SP, PP2, DP2 FSDP2 and CP2 train the same model as one
process (losses rel <= 1e-5 over 8 iterations), with query compression, YaRN and packed sequences (uneven
documents: ``reset_attention_mask``)."""

from __future__ import annotations

import pytest

from tests.helpers.layout_parity import TWO_PROCESS_LAYOUTS, assert_layout_matches_one_process, one_process_losses
from tests.parallel.harness import get_shared_pool
from tests.training.pretrain_helpers import mock_layout_run

ITERS = 8
REL = 1e-5
SEQ = 64


def _config(run_dir: str, tp: int = 1, sp: bool = False, pp: int = 1, cp: int = 1, fsdp2: bool = False):
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 4, 64, 128
    m.num_attention_heads, m.num_query_groups, m.seq_length, m.vocab_size = 4, None, SEQ, None
    m.multi_latent_attention, m.qk_layernorm = True, True
    m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim = 24, 16, 12, 8, 10
    m.position_embedding_type, m.yarn_original_max_position_embeddings = "yarn", 16
    m.rotary_scaling_factor, m.mscale, m.mscale_all_dim = 4.0, 0.8, 0.6
    m.tensor_model_parallel_size, m.sequence_parallel = tp, sp
    m.pipeline_model_parallel_size, m.context_parallel_size = pp, cp
    cfg.dataset.reset_attention_mask = cfg.dataset.reset_position_ids = True
    cfg.dist.use_torch_fsdp2 = fsdp2
    return mock_layout_run(cfg, f"{run_dir}/tb", SEQ, 2, 8, ITERS)


def _pretrain(run_dir: str, **layout) -> int:
    from longspan.training.pretrain import pretrain

    return pretrain(_config(run_dir, **layout)).train_state.step


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return one_process_losses(_pretrain, _config, str(tmp_path_factory.mktemp("mla_ref") / "ref"), ITERS)


@pytest.mark.slow
# TP2+SP here; plain TP2 of MLA trains in tests/parallel/test_deepseek_layouts.py (and its gradients are checked
# below)
@pytest.mark.parametrize("name", [name for name in TWO_PROCESS_LAYOUTS if name != "tp2"])
def test_mla_layout_matches_one_process(name, one_process, tmp_path):
    assert_layout_matches_one_process(name, one_process, _pretrain, _config, str(tmp_path), ITERS, REL)


# ------------------------------------------------------------------- the split module's gradients, 2 processes

def _mla_provider(q_lora_rank):
    import torch.nn.functional as F

    from longspan.models.gpt_provider import GPTModelProvider

    provider = GPTModelProvider(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=256,
        make_vocab_size_divisible_by=32, normalization="RMSNorm", position_embedding_type="rope",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, attention_dropout=0.0,
        hidden_dropout=0.0, multi_latent_attention=True, qk_layernorm=True, q_lora_rank=q_lora_rank,
        kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5)
    provider.finalize()
    return provider


def _tp_gradients(sequence_parallel: bool, q_lora_rank) -> dict:
    """Every parameter's gradient of the tp=2 split model equals the whole model's (full tensors)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from longspan.models.gpt import build_gpt_model, init_weights
    from longspan.parallel.loss_parallel import parallel_loss_context
    from longspan.parallel.tensor_parallel import apply_tensor_parallel
    from tests.parallel.harness import init_gloo

    init_gloo(timeout_s=60)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    provider = _mla_provider(q_lora_rank)
    whole = build_gpt_model(provider, seed=5, device="cpu")
    split = apply_tensor_parallel(build_gpt_model(provider, materialize=False), mesh, sequence_parallel)
    init_weights(split, seed=5, device="cpu")
    g = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 250, (2, 16), generator=g), torch.randint(0, 250, (2, 16), generator=g)
    ref = whole(tokens, labels=labels)
    ref.mean().backward()
    with parallel_loss_context(split):
        loss = split(tokens, labels=labels)
        loss.mean().backward()
    whole_params = dict(whole.named_parameters())
    diffs, placements = {}, {}
    for name, p in split.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        diffs[name] = float((grad - whole_params[name].grad).abs().max())
        placements[name] = str(tuple(p.placements)) if isinstance(p, DTensor) else None
    return {"loss": float((loss - ref).detach().abs().max()), "grads": diffs, "placements": placements}


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
@pytest.mark.parametrize("q_lora_rank", [8, None], ids=["q_lora", "no_q_lora"])
def test_tp_split_gradients_equal_the_whole_model(sequence_parallel, q_lora_rank):
    results = get_shared_pool(2).run(_tp_gradients, sequence_parallel, q_lora_rank, timeout=180)
    attn = "decoder.layers.0.self_attention"
    for r in results:
        assert r["loss"] < 1e-5
        bad = {n: d for n, d in r["grads"].items() if d > 1e-6}
        assert not bad, bad
        p = r["placements"]
        up = f"{attn}.linear_q_up_proj.weight" if q_lora_rank else f"{attn}.linear_q_proj.weight"
        assert p[up] == p[f"{attn}.linear_kv_up_proj.weight"] == "(Shard(dim=0),)"
        assert p[f"{attn}.linear_proj.weight"] == "(Shard(dim=1),)"
        assert p[f"{attn}.linear_kv_down_proj.weight"] is None and p[f"{attn}.kv_layernorm.weight"] is None
