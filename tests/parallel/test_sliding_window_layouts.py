"""Sliding-window attention under every layout: TP2+SP, PP2, DP2 FSDP2 and CP2 train the same model as one
process (losses rel <= 1e-5 over 8 iterations), on packed sequences (``reset_attention_mask``: document
boundaries and the window together) with alternating windowed / full layers and the block-local path on.

Context parallel's windowed attention (``_windowed_local_attention``) is also checked without processes: every
rank's output equals one process's, and key blocks wholly outside the window are skipped (counted).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.layout_parity import TWO_PROCESS_LAYOUTS, assert_layout_matches_one_process, one_process_losses
from tests.training.pretrain_helpers import mock_layout_run

from longspan.models import sliding_window as sw
from longspan.parallel import context_parallel as cpmod

ITERS = 8
REL = 1e-5
SEQ = 64
WINDOW = [7, 0]  # 8 positions with the token itself; layers 0 and 2 windowed, 1 and 3 full
CHUNK = 16  # the block-local path's query chunk: on at seq 64


def _config(run_dir: str, tp: int = 1, sp: bool = False, pp: int = 1, cp: int = 1, fsdp2: bool = False):
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 4, 64, 128
    m.num_attention_heads, m.num_query_groups, m.seq_length, m.vocab_size = 4, 2, SEQ, None
    m.window_size, m.window_attn_skip_freq = list(WINDOW), 2
    m.tensor_model_parallel_size, m.sequence_parallel = tp, sp
    m.pipeline_model_parallel_size, m.context_parallel_size = pp, cp
    # packed documents: boundaries and window together
    cfg.dataset.reset_attention_mask = cfg.dataset.reset_position_ids = True
    cfg.dist.use_torch_fsdp2 = fsdp2
    return mock_layout_run(cfg, f"{run_dir}/tb", SEQ, 2, 8, ITERS)


def _pretrain(run_dir: str, **layout) -> int:
    """Worker task (and the reference): pretrain with the block-local path's small chunks."""
    from longspan.training.pretrain import pretrain

    chunk, sw.MIN_CHUNK = sw.MIN_CHUNK, CHUNK
    try:
        return pretrain(_config(run_dir, **layout)).train_state.step
    finally:
        sw.MIN_CHUNK = chunk


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return one_process_losses(_pretrain, _config, str(tmp_path_factory.mktemp("swa_ref") / "ref"), ITERS)


@pytest.mark.slow
# tp2_sp, not plain tp2 as well: the window mask is built on the whole sequence either way
@pytest.mark.parametrize("name", [name for name in TWO_PROCESS_LAYOUTS if name != "tp2"])
def test_sliding_window_layout_matches_one_process(name, one_process, tmp_path):
    assert_layout_matches_one_process(name, one_process, _pretrain, _config, str(tmp_path), ITERS, REL)


# --------------------------------------------------------------------------- context parallel, no processes

def _cp_case(seq: int, window: int, cp: int, with_base: bool):
    g = torch.Generator().manual_seed(seq + window + cp)
    q = torch.randn(2, 4, seq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, seq, 8, generator=g, dtype=torch.float64) for _ in range(2))
    base = None
    if with_base:  # two packed documents
        base = ~torch.tril(torch.ones(seq, seq, dtype=torch.bool))
        base[seq // 3:, :seq // 3] = True
        base = base[None, None]
    return q, k, v, base


@pytest.mark.parametrize("seq,window,cp", [(64, 8, 2), (64, 20, 2), (96, 5, 3), (32, 64, 2)])
@pytest.mark.parametrize("with_base", [False, True])
def test_cp_windowed_attention_equals_one_process_and_skips_blocks(seq, window, cp, with_base):
    from longspan.models.attention import core_attention

    q, k, v, base = _cp_case(seq, window, cp, with_base)
    want = core_attention(q, k, v, sw.WindowedMask(window, base), 0.0, None)
    cpmod.WINDOW_BLOCKS.update(computed=0, skipped=0)
    chunk = seq // (2 * cp)
    for rank in range(cp):
        idx = cpmod.load_balanced_indices(seq, cp, rank)
        local_base = None if base is None else base.index_select(-2, idx)  # what the plan's input hook passes
        got = cpmod.local_attention(q.index_select(2, idx), k, v, cp, rank, sw.WindowedMask(window, local_base))
        torch.testing.assert_close(got, want.index_select(2, idx), atol=1e-12, rtol=0)
    # query chunk j needs key chunks from (j·c - window + 1) // c to j; the ones before are skipped
    expected_skipped = sum(max(0, j * chunk - window + 1) // chunk for j in range(2 * cp))
    assert cpmod.WINDOW_BLOCKS["skipped"] == expected_skipped
    assert cpmod.WINDOW_BLOCKS["computed"] + expected_skipped == sum(j + 1 for j in range(2 * cp))
    if window < chunk:
        assert expected_skipped > 0


def test_cp_windowed_attention_with_two_sided_image_blocks_across_chunks_equals_one_process():
    """Gemma 3's image tokens also see the later tokens of their image (a two-sided mask, ``causal=False``):
    under context parallel a sliding-window layer's query chunk then reaches keys in later chunks. Images that
    straddle chunk boundaries (chunks of 8: blocks 5-10 and 20-27) give every rank one process's rows."""
    from longspan.models.attention import core_attention
    from longspan.families.gemma_vl.model import image_attention_mask

    seq, window, cp = 32, 6, 2
    q, k, v, _ = _cp_case(seq, window, cp, with_base=False)
    token_type_ids = torch.zeros(2, seq, dtype=torch.long)
    token_type_ids[:, 5:11] = 1
    token_type_ids[0, 20:28] = 1
    base = image_attention_mask(token_type_ids).mask
    want = core_attention(q, k, v, sw.WindowedMask(window, base, causal=False), 0.0, None)
    for rank in range(cp):
        idx = cpmod.load_balanced_indices(seq, cp, rank)
        mask = sw.WindowedMask(window, base.index_select(-2, idx), causal=False)
        got = cpmod.local_attention(q.index_select(2, idx), k, v, cp, rank, mask)
        torch.testing.assert_close(got, want.index_select(2, idx), atol=1e-12, rtol=0)
