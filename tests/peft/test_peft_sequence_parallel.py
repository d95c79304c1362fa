"""PEFT under tensor parallel with sequence parallel (TP2+SP) equals one process.

Why this needed proving: torch's ``SequenceParallel`` style re-registers the norm weights as new Parameters that
always require grad, so before the fix a frozen base came out of the TP+SP plan with trainable norms (they
then trained and entered the grad norm). And adapter dropout drew its masks on each rank's part of the input
(other elements than one process, a crash on a row-parallel layer's partial sums with 'post' dropout). These
tests check, on 2 gloo ranks:

- per adapter parameter, the gradient of a TP2+SP (and TP2) model equals the one-process gradient over a few
  SGD steps with uneven loss masks, hidden dropout and adapter dropout ('pre' and 'post') on, and only the
  adapters require grad (LoRA, DoRA, CanonicalLoRA);
- an HF model finetuned with SFT data (uneven masks) and adapter dropout under TP2+SP logs one process's losses
  and grad norms, and its HF PEFT adapter export (``convert export --adapter-only``) equals the one-process
  export and loads with ``peft`` onto the transformers base.
"""

from __future__ import annotations

import json
from pathlib import Path

import peft as hf_peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

from longspan.cli import main as cli_main
from longspan.peft.hf_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tests.conversion.hf_models import hf_logits, make_hf_model
from tests.data.sft.conftest import qa_records, write_jsonl
from tests.parallel.harness import get_shared_pool, init_gloo
from tests.parallel.test_tp_plans import small_provider
from tests.training.pretrain_helpers import read_metrics, small_config

KINDS = ["lora", "dora", "canonical"]
STEPS = 3
ATOL = 1e-6


def _peft(kind: str, dropout: float = 0.0, dropout_position: str = "pre"):
    from longspan.peft import CanonicalLoRA, DoRA, LoRA

    return {"lora": LoRA, "dora": DoRA, "canonical": CanonicalLoRA}[kind](
        dim=4, alpha=8, dropout=dropout, dropout_position=dropout_position)


def _adapted_model(provider, peft, tp_mesh=None, sequence_parallel: bool = True):
    """The small model with adapters, whole (``tp_mesh`` None) or split over TP2+SP; B moved off zero so the
    first step already has non-zero A gradients."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from longspan.models.gpt import build_gpt_model, init_weights
    from longspan.parallel.tensor_parallel import apply_tensor_parallel
    from longspan.peft.adapters import init_adapters, init_dora_magnitudes

    model = build_gpt_model(provider, materialize=False)
    peft.apply(model)
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh, sequence_parallel=sequence_parallel)
    init_weights(model, seed=5, device="cpu")
    init_adapters([model], 5)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_out.weight"):
                full = torch.randn(p.shape, generator=g) * 0.05
                if isinstance(p, DTensor):
                    p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                                       .to_local())
                else:
                    p.copy_(full)
    init_dora_magnitudes([model])
    return model


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _sp_adapter_case(kind: str, sequence_parallel: bool = True, dropout: float = 0.0, position: str = "pre") -> dict:
    """STEPS SGD steps of a whole and a TP2(+SP) adapted model on the same batches; the largest differences.

    SGD, not Adam: Adam divides each gradient element by its own running size, so an element whose gradient is
    nearly zero turns a 1e-7 summation-order difference into a much larger weight difference; with SGD the
    weights differ as the gradients do. (Adam under TP2+SP: test_peft_layouts.py, through finetune().)
    """
    from torch.distributed.device_mesh import init_device_mesh

    from longspan.parallel.loss_parallel import parallel_loss_context

    init_gloo(timeout_s=60)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    provider = small_provider(hidden_dropout=0.1)  # SP draws the full-sequence masks: layout-independent
    peft = _peft(kind, dropout, position)
    whole, split = _adapted_model(provider, peft), _adapted_model(provider, peft, mesh, sequence_parallel)
    trainable = {n for n, p in split.named_parameters() if p.requires_grad}
    out = {"trainable_split": sorted(trainable),
           "trainable_whole": sorted(n for n, p in whole.named_parameters() if p.requires_grad),
           "loss_diff": 0.0, "grad_diff": 0.0, "grad_max": 0.0, "param_diff": 0.0, "nonzero_grads": 0}
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9, foreach=False)
            for m in (whole, split)]
    whole_params = dict(whole.named_parameters())
    g = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        tokens = torch.randint(0, 250, (2, 16), generator=g)
        labels = torch.randint(0, 250, (2, 16), generator=g)
        mask = torch.zeros(2, 16)
        mask[0, 3:11 + step] = 1.0  # uneven: different counts per sample and per step
        mask[1, :2 + 3 * step] = 1.0
        losses = []
        for model, opt in zip((whole, split), opts):
            opt.zero_grad()
            torch.manual_seed(100 + step)
            with parallel_loss_context(model):
                per_token = model(tokens, labels=labels)
                loss = (per_token * mask).sum() / mask.sum()
                loss.backward()
            losses.append(loss.detach())
        out["loss_diff"] = max(out["loss_diff"], float((losses[0] - losses[1]).abs() / losses[0].abs()))
        for name, p in split.named_parameters():
            ref = whole_params[name].grad
            if p.grad is None or ref is None:
                assert p.grad is None and ref is None, name
                continue
            out["grad_diff"] = max(out["grad_diff"], float((_full(p.grad) - ref).abs().max()))
            out["grad_max"] = max(out["grad_max"], float(ref.abs().max()))
            out["nonzero_grads"] += int(bool(ref.abs().max() > 0))
        for opt in opts:
            opt.step()
    for name, p in split.named_parameters():
        out["param_diff"] = max(out["param_diff"], float((_full(p.detach()) - whole_params[name].detach()).abs().max()))
    return out


#: (kind, sequence_parallel, adapter dropout, dropout position); hidden dropout is on in every case
CASES = [
    ("lora", True, 0.1, "pre"), ("dora", True, 0.1, "pre"), ("canonical", True, 0.1, "pre"),
    ("lora", True, 0.1, "post"), ("canonical", True, 0.1, "post"), ("lora", False, 0.1, "post"),
    ("dora", True, 0.0, "pre"),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind,sequence_parallel,dropout,position", CASES,
                         ids=[f"{k}-{'tp2_sp' if sp else 'tp2'}-{d}-{pos}" for k, sp, d, pos in CASES])
def test_adapter_gradients_under_tp2_sp_match_one_process(kind: str, sequence_parallel: bool, dropout: float,
                                                          position: str) -> None:
    results = get_shared_pool(2).run(_sp_adapter_case, kind, sequence_parallel, dropout, position, timeout=180)
    for r in results:
        assert r["trainable_split"] == r["trainable_whole"]
        assert r["trainable_split"] and all(".adapter." in n for n in r["trainable_split"])
        assert r["nonzero_grads"] == STEPS * len(r["trainable_split"])  # every adapter gradient compared, non-zero
        assert r["loss_diff"] <= 1e-5, r  # relative
        assert r["grad_diff"] <= ATOL, r
        assert r["grad_max"] > 1e-3, r  # the tolerance is small next to the gradients
        assert r["param_diff"] <= ATOL, r


def test_tensor_parallel_plans_keep_frozen_norms_frozen() -> None:
    """The cause itself: a frozen norm stays frozen through the sequence-parallel plan (torch's SequenceParallel
    style would hand back a Parameter that requires grad)."""
    results = get_shared_pool(2).run(_frozen_norms_case, timeout=120)
    assert results[0] == results[1] == {"decoder.final_layernorm.weight": (False, True)}


def _frozen_norms_case() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from longspan.models.gpt import build_gpt_model
    from longspan.parallel.tensor_parallel import apply_tensor_parallel

    init_gloo(timeout_s=60)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = build_gpt_model(small_provider(), materialize=False)
    model.decoder.final_layernorm.weight.requires_grad_(False)
    apply_tensor_parallel(model, mesh, sequence_parallel=True)
    norms = {n: (p.requires_grad, hasattr(p, "device_mesh")) for n, p in model.named_parameters() if "norm" in n}
    assert all(flag for n, (flag, _) in norms.items() if n != "decoder.final_layernorm.weight")
    return {n: v for n, v in norms.items() if n == "decoder.final_layernorm.weight"}


def test_full_mask_dropout_is_torch_dropout_on_one_process() -> None:
    from longspan.peft.modules import FullMaskDropout

    x = torch.randn(3, 5, 7)
    torch.manual_seed(4)
    expected = torch.nn.functional.dropout(x, 0.3, True)
    after = torch.rand(1)
    torch.manual_seed(4)
    assert torch.equal(FullMaskDropout(0.3)(x), expected)
    assert torch.equal(torch.rand(1), after)  # the same random numbers consumed
    assert torch.equal(FullMaskDropout(0.3).eval()(x), x)


# ----------------------------------------------------------------------------------- HF model in, HF PEFT out

ITERS = 4
REL = 1e-5


def _finetune_config(root: str, name: str, kind: str, tp: int):
    from longspan.training.config import FinetuningDatasetConfig

    cfg = small_config(Path(root), name, train_iters=ITERS, eval_interval=100)
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = f"{root}/hf"
    cfg.tokenizer.vocab_size = None
    cfg.checkpoint.pretrained_checkpoint = f"{root}/hf"
    cfg.checkpoint.save_interval = ITERS
    cfg.model.seq_length = 32
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.0
    cfg.model.tensor_model_parallel_size, cfg.model.sequence_parallel = tp, tp > 1
    cfg.dataset = FinetuningDatasetConfig(dataset_root=f"{root}/data", seq_length=32, num_workers=0,
                                          do_validation=False)
    # SGD: Adam divides each gradient by its own running size, so an element whose gradient is nearly zero (A
    # after a first step with B = 0) turns a 1e-7 summation-order difference into a ~1e-6 weight difference; with
    # SGD the exported weights differ as the gradients do. Adam under TP2+SP: test_peft_layouts.py.
    cfg.optimizer.optimizer, cfg.optimizer.lr = "sgd", 0.5
    cfg.dist.distributed_backend, cfg.dist.distributed_timeout_minutes = "gloo", 1
    cfg.peft = _peft(kind, dropout=0.1)  # adapter dropout on: its masks do not depend on the layout
    return cfg


def _finetune(root: str, name: str, kind: str, tp: int) -> list[tuple[float, float, int]]:
    from longspan.training.finetune import finetune
    from longspan.training.step.forward_step import forward_step

    cfg = _finetune_config(root, name, kind, tp)
    finetune(cfg, forward_step)
    return [(r["losses"]["lm loss"], r["grad_norm"], r["loss_tokens"]) for r in read_metrics(cfg)]


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("peft_sp_hf")
    make_hf_model("qwen2", root / "hf")  # qkv biases: column-parallel biases next to the adapters
    write_jsonl(str(root / "data" / "training.jsonl"), qa_records(48, seed=3, skew=True))
    return str(root)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_hf_finetune_under_tp2_sp_exports_the_one_process_adapter(kind: str, hf_root: str) -> None:
    ref = _finetune(hf_root, f"ref_{kind}", kind, tp=1)
    runs = get_shared_pool(2).run(_finetune, hf_root, f"tp2sp_{kind}", kind, 2, timeout=300)
    assert runs[0] == runs[1]
    tokens = [t for _, _, t in ref]
    assert len(ref) == ITERS and len(set(tokens)) > 1  # uneven masks: loss tokens differ between batches
    assert [t for _, _, t in runs[0]] == tokens
    assert [x[0] for x in runs[0]] == pytest.approx([x[0] for x in ref], rel=REL)
    assert [x[1] for x in runs[0]] == pytest.approx([x[1] for x in ref], rel=REL)

    exports = {}
    for name in (f"ref_{kind}", f"tp2sp_{kind}"):
        out = Path(hf_root) / f"{name}_adapter"
        assert cli_main(["convert", "export", "--checkpoint", f"{hf_root}/{name}/ckpt", "--output", str(out),
                         "--adapter-only"]) == 0
        exports[name] = (json.loads((out / ADAPTER_CONFIG).read_text()), load_file(str(out / ADAPTER_WEIGHTS)), out)
    (ref_cfg, ref_w, _), (sp_cfg, sp_w, sp_dir) = exports[f"ref_{kind}"], exports[f"tp2sp_{kind}"]
    assert sp_cfg == ref_cfg
    assert sorted(sp_w) == sorted(ref_w) and ref_w
    worst = max(float((sp_w[k] - ref_w[k]).abs().max()) for k in ref_w)
    assert worst <= ATOL, worst

    base = transformers.AutoModelForCausalLM.from_pretrained(f"{hf_root}/hf")
    ids = torch.randint(0, 80, (2, 10), generator=torch.Generator().manual_seed(0))
    before = hf_logits(base, ids)
    with_adapter = hf_peft.PeftModel.from_pretrained(base, str(sp_dir))
    assert (hf_logits(with_adapter, ids) - before).abs().max().item() > 1e-4  # training moved the adapters
