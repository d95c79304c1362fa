"""QLoRA under TP2, TP2 with sequence parallel, FSDP2, PP2 and DDP through ``finetune()``: the logged losses and
gradient norms match one process (fp32 CPU, rel 1e-5).

Like with like: NF4 blocks run along each row's input columns (64 at a time) and never cross rows. Column-parallel
shards hold whole rows; row-parallel shards of this model hold 64 (linear_proj: 128 / 2) or 128 (linear_fc2:
256 / 2) columns, multiples of the block size, so each TP rank quantizes exactly the blocks one process does.
Under FSDP2 the NF4 base weights stay out of ``fully_shard`` and every rank quantizes the whole weight, as one
process does; pipeline stages quantize the layers they hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel.harness import get_shared_pool
from tests.peft.test_peft_layouts import ITERS, REL, _config as _layout_config, _logged

pytestmark = pytest.mark.slow


def _config(run_dir: str, base: str | None, **layout):
    from longspan.peft import LoRA

    cfg = _layout_config(run_dir, base, **layout)
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 2, 128, 256
    if base is not None:
        cfg.peft = LoRA(dim=4, alpha=8, base_quantization="nf4")
    return cfg


def _finetune(run_dir: str, base: str, **layout) -> int:
    from longspan.training.finetune import finetune

    return finetune(_config(run_dir, base, **layout)).train_state.step


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    from longspan.training.pretrain import pretrain

    run = str(tmp_path_factory.mktemp("qlora_layout_base"))
    pretrain(_config(run, None, iters=2))
    return f"{run}/ckpt"


@pytest.fixture(scope="module")
def reference(base: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], list[float]]:
    run = tmp_path_factory.mktemp("qlora_ref")
    assert _finetune(str(run), base) == ITERS
    return _logged(run)


LAYOUTS = {"tp2": dict(tp=2), "tp2_sp": dict(tp=2, sp=True), "dp2_fsdp2": dict(fsdp2=True), "pp2": dict(pp=2), "dp2_ddp": dict()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qlora_layout_matches_one_process(layout: str, base: str, reference: tuple, tmp_path: Path) -> None:
    steps = get_shared_pool(2).run(_finetune, str(tmp_path), base, timeout=300, **LAYOUTS[layout])
    assert steps == [ITERS, ITERS]
    losses, norms = _logged(tmp_path)
    ref_losses, ref_norms = reference
    assert losses == pytest.approx(ref_losses, rel=REL)
    assert norms == pytest.approx(ref_norms, rel=REL)
