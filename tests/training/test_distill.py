"""Knowledge distillation on one process (``longspan.training.distill``; the layouts are
tests/parallel/test_distill_layouts.py's).

- The chunked KL equals ModelOpt's ``LogitsKLLoss`` on whole logits (values and the student's gradients).
- A tiny student distilled from a tiny HF teacher for 50 iterations ends with a lower KL to the teacher than the
  same student trained on the LM loss alone (``skip_lm_loss=False, kd_loss_scale=0``: the same run with the KL
  only logged); both start from the same KL.
- The teacher is frozen: no gradient, eval mode, its weights at the end those it started with.
- Intermediate layer pairs add their cosine loss, rescaled to the KL's magnitude (ModelOpt's balance).
- Bad inputs are one-line errors naming the field (the CLI exits 2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longspan.cli import main
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.training.callbacks import Callback
from longspan.training.distill import (
    ModelOptDistillConfig,
    convert_to_distillation_provider,
    distill,
    teacher_provider_from,
)
from longspan.training.distill.kd_loss import linear_kl_divergence
from tests.helpers.distill import distill_config, logged, write_teacher

ITERS = 50


def test_chunked_kl_is_modelopts_logits_kl_on_whole_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden_s = torch.randn(2, 5, 6, generator=gen, requires_grad=True)
    weight_s = torch.randn(11, 6, generator=gen, requires_grad=True)
    hidden_t, weight_t = torch.randn(2, 5, 8, generator=gen), torch.randn(11, 8, generator=gen)
    temperature = 2.0
    kl = linear_kl_divergence(hidden_s, weight_s, hidden_t, weight_t, temperature, chunk_tokens=3)
    log_p_s = F.log_softmax(hidden_s @ weight_s.t() / temperature, dim=-1)
    log_p_t = F.log_softmax(hidden_t @ weight_t.t() / temperature, dim=-1)
    want = F.kl_div(log_p_s, log_p_t, reduction="none", log_target=True).sum(-1)
    torch.testing.assert_close(kl, want, rtol=1e-5, atol=1e-6)
    scale = torch.randn(2, 5, generator=gen)
    got_grads = torch.autograd.grad((kl * scale).sum(), (hidden_s, weight_s))
    want_grads = torch.autograd.grad((want * scale).sum(), (hidden_s, weight_s))
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


class _TeacherSnapshot(Callback):
    """Keeps the teacher's weights as the run starts (the teacher is built after setup, before training)."""

    def __init__(self) -> None:
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self, context) -> None:
        chunk = context.state.distill_teacher.chunks[0]
        self.start = {name: p.detach().clone() for name, p in chunk.named_parameters()}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_teacher(str(tmp_path_factory.mktemp("teacher")))


@pytest.fixture(scope="module")
def runs(teacher_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The distilled run (the KL alone) and the LM-only run, ``ITERS`` iterations each from the same start."""
    out: dict = {"teacher_dir": teacher_dir}
    for name, fields in (("kd", {}), ("lm", dict(skip_lm_loss=False, kd_loss_scale=0.0))):
        run_dir = str(tmp_path_factory.mktemp(name))
        snapshot = _TeacherSnapshot()
        cfg = distill_config(run_dir, teacher_dir, ITERS, **fields)
        cfg.checkpoint.save = f"{run_dir}/ckpt"  # the student's checkpoint at the end: a teacher for another test
        state = distill(cfg, callbacks=[snapshot])
        out[name] = dict(log=logged(run_dir), teacher=state.distill_teacher, start=snapshot.start,
                         checkpoint=cfg.checkpoint.save)
    return out


def _tail_mean(values: list[float], n: int = 5) -> float:
    return sum(values[-n:]) / n


def test_distilled_student_ends_closer_to_the_teacher_than_lm_training(runs: dict) -> None:
    kd, lm = runs["kd"]["log"], runs["lm"]["log"]
    assert kd["iterations"] == lm["iterations"] == list(range(1, ITERS + 1))
    assert kd["logits distillation loss"][0] == lm["logits distillation loss"][0]  # same student, same batch
    assert kd["total loss"] == kd["logits distillation loss"]  # skip_lm_loss: the KL is the loss
    assert lm["total loss"] == lm["lm loss"]  # kd_loss_scale=0: the LM loss alone
    assert _tail_mean(lm["lm loss"]) < lm["lm loss"][0] * 0.9  # the LM-only student did learn
    assert _tail_mean(kd["logits distillation loss"]) < 0.9 * _tail_mean(lm["logits distillation loss"])


def test_teacher_is_frozen_and_unchanged(runs: dict) -> None:
    teacher = runs["kd"]["teacher"]
    chunk = teacher.chunks[0]
    assert not chunk.training
    params = dict(chunk.named_parameters())
    assert params and set(params) == set(runs["kd"]["start"])
    for name, param in params.items():
        assert not param.requires_grad and param.grad is None, name
        assert torch.equal(param, runs["kd"]["start"][name]), f"teacher {name} changed"
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(runs["teacher_dir"])  # the teacher ran with the HF directory's weights
    assert torch.equal(params["output_layer.weight"], hf.lm_head.weight.detach())
    assert torch.equal(params["embedding.word_embeddings.weight"], hf.model.embed_tokens.weight.detach())


def test_a_longspan_checkpoint_is_a_teacher_and_only_the_student_is_saved(runs: dict, tmp_path) -> None:
    from longspan.training.checkpointing.model_loading import load_model_from_checkpoint

    saved = load_model_from_checkpoint(runs["lm"]["checkpoint"], device="cpu")
    assert {name.split(".")[0] for name, _ in saved.model[0].named_parameters()} == {"embedding", "decoder",
                                                                                      "output_layer"}
    assert saved.cfg.model.hidden_size == 32  # the student, not the teacher (hidden 48)
    state = distill(distill_config(str(tmp_path), runs["lm"]["checkpoint"], 3))
    teacher = dict(state.distill_teacher.chunks[0].named_parameters())
    for name, param in saved.model[0].named_parameters():
        assert torch.equal(teacher[name], param), name


def _convert(student, teacher_dir: str, **kd_fields):
    return convert_to_distillation_provider(student, teacher_provider_from(teacher_dir),
                                            ModelOptDistillConfig(**kd_fields), teacher_checkpoint=teacher_dir)


@pytest.mark.parametrize("fields, error, words", [
    (dict(intermediate_layer_pairs=[["decoder.final_layernorm"]]), ConfigError,
     "kd_config.intermediate_layer_pairs entry ['decoder.final_layernorm'] must be a [student module, teacher module]"),
    (dict(logit_layers=["decoder", "output_layer"]), NotSupportedError, "kd_config.logit_layers="),
    (dict(logit_kl_temperature=0.0), ConfigError, "kd_config.logit_kl_temperature=0.0 must be a number > 0"),
    (dict(kd_loss_scale=-1.0), ConfigError, "kd_config.kd_loss_scale=-1.0 must be a number >= 0"),
])
def test_bad_kd_settings_are_one_line_errors(fields: dict, error: type, words: str, teacher_dir: str,
                                             tmp_path) -> None:
    cfg = distill_config(str(tmp_path), teacher_dir, 1)
    with pytest.raises(error, match=words.replace("[", r"\[").replace(".", r"\.")) as info:
        _convert(cfg.model, teacher_dir, **fields)
    assert "\n" not in str(info.value)


def test_what_distill_cannot_run_is_a_one_line_error(teacher_dir: str, tmp_path) -> None:
    from longspan.recipes import get_recipe

    with pytest.raises(ConfigError, match="distill\\(\\) needs config.model to be a DistillationProvider"):
        distill(get_recipe("tiny"))
    # the student's vocabulary comes from its tokenizer: told after setup, before the teacher is built
    cfg = distill_config(str(tmp_path), teacher_dir, 3)
    cfg.model.teacher.vocab_size = 512
    with pytest.raises(ConfigError, match="model.teacher.vocab_size=512 differs from the student's "
                                          "model.vocab_size=256"):
        distill(cfg)
    cfg = distill_config(str(tmp_path), teacher_dir, 3)
    cfg.model.virtual_pipeline_model_parallel_size = 2
    with pytest.raises(NotSupportedError, match="virtual_pipeline_model_parallel_size=2"):
        distill(cfg)
    cfg = distill_config(str(tmp_path), teacher_dir, 3)
    cfg.model.teacher_checkpoint = None
    with pytest.raises(ConfigError, match="distillation needs the teacher's weights"):
        distill(cfg)
    with pytest.raises(ConfigError, match="teacher checkpoint .* does not exist"):
        teacher_provider_from(str(tmp_path / "nowhere"))


def test_intermediate_layer_pairs_add_their_cosine_loss_at_the_logits_loss_magnitude(teacher_dir: str,
                                                                                     tmp_path) -> None:
    pairs = [["decoder.final_layernorm", "decoder.final_layernorm"], ["decoder.layers.0", "decoder.layers.0"]]
    distill(distill_config(str(tmp_path), teacher_dir, 3, hidden=48, intermediate_layer_pairs=pairs))
    log = logged(str(tmp_path))
    for kl, inter, total in zip(log["logits distillation loss"], log["intermediate distillation loss"],
                                log["total loss"], strict=True):
        assert 0.0 < inter < 2.0  # a mean of 1 - cos
        assert total == pytest.approx(2.0 * kl, rel=1e-6)  # ModelOpt's balance: the cosine loss scaled to the KL
    bad = [["decoder.final_layernorm", "decoder.no_such_norm"]]
    missing = r"intermediate_layer_pairs\[0\]: the teacher has no module 'decoder.no_such_norm'"
    with pytest.raises(ConfigError, match=missing):
        distill(distill_config(str(tmp_path / "missing"), teacher_dir, 3, hidden=48, intermediate_layer_pairs=bad))
    sizes = r"gives \[2, 32, 32\], the teacher's decoder.final_layernorm \[2, 32, 48\]"
    with pytest.raises(NotSupportedError, match=sizes):
        distill(distill_config(str(tmp_path / "sizes"), teacher_dir, 3, intermediate_layer_pairs=pairs[:1]))


def test_cli_teacher_of_another_vocabulary_exits_2(tmp_path, capsys) -> None:
    other = write_teacher(str(tmp_path / "teacher512"), vocab_size=512)
    code = main(["distill", "--teacher", other, f"checkpoint.save={tmp_path}/ckpt", "checkpoint.load=null"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2  # the recipe's student (vocabulary 4096) is checked before any work
    assert err[-1] == ("longspan: error: model.teacher.vocab_size=512 differs from the student's "
                       "model.vocab_size=4096: the KL loss compares the two models' distributions token by token, "
                       "so the teacher must use the student's tokenizer and vocabulary")
