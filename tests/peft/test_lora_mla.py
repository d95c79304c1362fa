"""LoRA on multi-latent attention: the MLA projections (linear_q_proj, or linear_q_down_proj + linear_q_up_proj;
linear_kv_down_proj, linear_kv_up_proj; linear_proj) take adapters under their own names (megatron-core's, as
Bridge's DeepSeek / Moonlight recipes target them), the adapters train (loss falls, the base stays frozen), and
the merged weights are base + scale·B·A; under TP2 they train as on one process, and they export in HF PEFT
format onto DeepSeek-V3 with transformers + peft computing the same logits."""

from __future__ import annotations

import pytest
import torch

from longspan.config.schema.optim import OptimizerConfig
from longspan.core.errors import ConfigError
from longspan.models.gpt import build_gpt_model, init_weights
from longspan.peft import CanonicalLoRA, LoRA
from longspan.peft.adapters import init_adapters, is_adapter_key, merged_state_dict
from longspan.peft.modules import LoRALinear
from longspan.training.optim.optimizer import get_megatron_optimizer
from tests.models.test_mla import mla_config

SEED = 7
MLA_TARGETS = {24: ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
                    "linear_proj"],
               None: ["linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]}


def _adapted(cfg, peft):
    model = build_gpt_model(cfg, materialize=False)
    peft.apply(model)
    init_weights(model, seed=SEED)
    init_adapters([model], SEED)
    return model


def _base(cfg):
    model = build_gpt_model(cfg, materialize=False)
    init_weights(model, seed=SEED)
    return model


def _adapted_names(model) -> set[str]:
    return {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, LoRALinear)}


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "no_q_lora"])
@pytest.mark.parametrize("peft_class", [LoRA, CanonicalLoRA])
def test_mla_projections_take_adapters_by_name(q_lora_rank, peft_class) -> None:
    cfg = mla_config(q_lora_rank=q_lora_rank)
    model = _adapted(cfg, peft_class(target_modules=MLA_TARGETS[q_lora_rank], dim=4, alpha=8))
    assert _adapted_names(model) == set(MLA_TARGETS[q_lora_rank])
    per_layer = {n for n, m in model.named_modules() if isinstance(m, LoRALinear) and ".layers.1." in n}
    assert len(per_layer) == len(MLA_TARGETS[q_lora_rank])


def test_default_lora_targets_cover_the_mla_output_projection_and_mlp() -> None:
    """Bridge's default targets (linear_qkv, linear_proj, linear_fc1, linear_fc2): MLA has no linear_qkv; the
    rest adapt."""
    model = _adapted(mla_config(), LoRA(dim=4, alpha=8))
    assert _adapted_names(model) == {"linear_proj", "linear_fc1", "linear_fc1_gate", "linear_fc2"}


def test_a_target_matching_nothing_names_the_mla_projections() -> None:
    with pytest.raises(ConfigError, match="linear_kv_down_proj"):
        _adapted(mla_config(), LoRA(target_modules=["linear_nope"], dim=4, alpha=8))


def test_lora_on_mla_trains_and_merges_into_base_plus_scaled_ba() -> None:
    cfg = mla_config()
    peft = LoRA(target_modules=MLA_TARGETS[24], dim=4, alpha=8)
    model = _adapted(cfg, peft)
    base = _base(cfg).eval()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter_key(n)}
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0), [model])
    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)
    losses = []
    for _ in range(12):
        loss = model(ids, labels=labels).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.95, losses
    for name, p in model.named_parameters():
        if not is_adapter_key(name):
            assert torch.equal(p, frozen[name]), name

    merged = merged_state_dict(model)
    base_state = base.state_dict()
    scale = peft.alpha / peft.dim
    checked = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, LoRALinear):
            continue
        a, b = layer.adapter.shared_in.weight, layer.adapter.linear_out.weight
        assert b.abs().max() > 0  # trained away from the zero start
        expected = base_state[f"{name}.weight"] + scale * (b @ a)
        torch.testing.assert_close(merged[f"{name}.weight"], expected, rtol=0, atol=1e-6)
        checked += 1
    assert checked == 2 * len(MLA_TARGETS[24])
    plain = build_gpt_model(cfg, materialize=False)
    plain.to_empty(device="cpu")
    plain.load_state_dict(merged)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(ids), model(ids), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------- under tensor parallel, through finetune()

ITERS = 5


def _finetune_config(run_dir: str, base: str | None, tp: int = 1):
    """A tiny dense MLA model (query compression) on mock data; with ``base`` a LoRA finetune of every MLA
    projection, else the 2-iteration pretrain that makes the base."""
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 2, 64, 128
    m.num_attention_heads, m.num_query_groups, m.seq_length, m.vocab_size = 4, None, 64, None
    m.multi_latent_attention, m.qk_layernorm = True, True
    m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim = 24, 16, 12, 8, 10
    m.tensor_model_parallel_size = tp
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model, cfg.tokenizer.vocab_size = "NullTokenizer", None, 255
    cfg.dataset.data_path, cfg.dataset.sequence_length = None, 64
    t = cfg.train
    t.micro_batch_size, t.global_batch_size = 2, 8
    t.train_iters = ITERS if base else 2
    t.eval_interval, t.eval_iters = None, 0
    cfg.scheduler.lr_warmup_fraction, cfg.scheduler.lr_warmup_iters = None, 1
    cfg.optimizer.lr = 1e-2
    cfg.dist.distributed_backend, cfg.dist.distributed_timeout_minutes = "gloo", 1
    cfg.checkpoint.save = None if base else f"{run_dir}/ckpt"
    cfg.checkpoint.save_interval = None if base else 2
    cfg.checkpoint.load = None
    cfg.checkpoint.pretrained_checkpoint = base
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = f"{run_dir}/tb"
    if base:
        cfg.peft = LoRA(target_modules=MLA_TARGETS[24], dim=4, alpha=8)
    return cfg


def _finetune(run_dir: str, base: str, tp: int = 1) -> None:
    from longspan.training.finetune import finetune

    finetune(_finetune_config(run_dir, base, tp))


def _logged(run_dir: str) -> list[tuple[float, float]]:
    import json

    rows = [json.loads(line) for line in open(f"{run_dir}/tb/metrics.jsonl")]
    rows = [r for r in rows if r.get("phase", "train") == "train"]
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    return [(r["losses"]["lm loss"], r["grad_norm"]) for r in rows]


@pytest.mark.slow
def test_lora_on_mla_under_tp2_matches_one_process(tmp_path) -> None:
    from longspan.training.pretrain import pretrain
    from tests.parallel.harness import get_shared_pool

    pretrain(_finetune_config(str(tmp_path / "base"), None))
    base = str(tmp_path / "base" / "ckpt")
    _finetune(str(tmp_path / "one"), base)
    get_shared_pool(2).run(_finetune, str(tmp_path / "tp2"), base, 2, timeout=300)
    want, got = _logged(str(tmp_path / "one")), _logged(str(tmp_path / "tp2"))
    assert abs(want[-1][0] - want[0][0]) > 1e-3  # the adapters move the loss: a layout dropping them shows
    for it, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, want), start=1):
        assert loss == pytest.approx(want_loss, rel=1e-5), (it, loss, want_loss)
        assert norm == pytest.approx(want_norm, rel=1e-5), (it, norm, want_norm)


# --------------------------------------------------------------- HF PEFT export of MLA adapters


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "no_q_lora"])
def test_mla_adapters_export_to_hf_peft_on_deepseek_v3(q_lora_rank, tmp_path) -> None:
    """Adapters on an imported DeepSeek-V3 (MoE) model's MLA projections, written in HF PEFT format
    (q_a_proj / q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj), load with peft onto transformers'
    model and give longspan's logits."""
    import peft as hf_peft

    from longspan.conversion import AutoBridge
    from longspan.peft.hf_export import save_hf_peft_adapter
    from tests.conversion.test_deepseek_moe import VOCAB, save_random_deepseek_moe

    hf = save_random_deepseek_moe(tmp_path / "hf", q_lora_rank)
    bridge = AutoBridge.from_hf_pretrained(tmp_path / "hf")
    model = bridge.to_megatron_model()[0]
    config = LoRA(target_modules=MLA_TARGETS[q_lora_rank], dim=4, alpha=8)
    config.apply(model)
    init_adapters([model], seed=5)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_out.weight"):  # as after training: non-zero B
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()(tokens)
        base = hf(input_ids=tokens).logits
    save_hf_peft_adapter(model, config, bridge, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "hf"))
    peft_model = hf_peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (theirs - base).abs().max().item() > 1e-3  # the adapters change the outputs
    attn = peft_model.base_model.model.model.layers[1].self_attn
    adapted = {n for n in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
               if hasattr(getattr(attn, n, None), "lora_A")}
    assert adapted == ({"q_a_proj", "q_b_proj"} if q_lora_rank else {"q_proj"}) | {"kv_a_proj_with_mqa",
                                                                                   "kv_b_proj", "o_proj"}
