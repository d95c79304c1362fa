"""tiny-t5 through pretrain(): the T5 forward step is picked, the loss falls, stop-and-resume is bit-exact
(dropout on), and the batches are the T5 dataset's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from longspan.core.errors import ConfigError, DataError
from longspan.data.loaders import build_train_valid_test_data_iterators
from longspan.data.tokenizers import build_tokenizer
from longspan.models.t5 import T5Model
from longspan.recipes import get_recipe
from longspan.training.pretrain import pretrain
from longspan.training.state import TrainState
from tests.models.t5.t5_test_config import small_t5_run
from tests.training.pretrain_helpers import losses_by_iteration


@pytest.mark.slow
def test_tiny_t5_trains_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    straight = small_t5_run(tmp_path, "straight", dropout=0.1)
    state = pretrain(straight)  # no forward step given: the T5 one is picked for a T5ModelProvider
    reference = losses_by_iteration(straight)
    assert sorted(reference) == list(range(1, 13))
    assert sum(reference[i] for i in (10, 11, 12)) < sum(reference[i] for i in (1, 2, 3)) - 0.3
    assert state.train_state.step == 12

    stopped = small_t5_run(tmp_path, "resumed", dropout=0.1, exit_interval=5)
    assert pretrain(stopped).train_state.step == 5
    resumed_cfg = small_t5_run(tmp_path, "resumed", dropout=0.1)
    pretrain(resumed_cfg)
    resumed = losses_by_iteration(resumed_cfg)
    assert [resumed[i] for i in range(1, 13)] == [reference[i] for i in range(1, 13)]


def test_t5_batches_from_the_loaders(tmp_path: Path) -> None:
    cfg = small_t5_run(tmp_path)
    cfg.validate()
    tokenizer = build_tokenizer(cfg.tokenizer)
    assert tokenizer.vocab_size == 512 + 1 + 20 and tokenizer.bos == 512  # <bos> added, then 20 sentinels
    train, valid, test = build_train_valid_test_data_iterators(cfg, TrainState(), tokenizer)
    batch = next(train)
    assert batch["text_enc"].shape == (2, 64) and batch["text_dec"].shape == (2, 32)
    assert set(batch) == {"text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask"}
    assert (batch["text_dec"][:, 0] == tokenizer.bos).all()
    sentinels = torch.tensor(tokenizer.additional_special_tokens_ids)
    # The corpus is longspan's own source, so a sample may be a few spaces with nothing to mask: every sample
    # with some text has a masked span.
    has_text = (batch["text_enc"] > 1).sum(dim=1) > 8
    assert has_text.any() and torch.isin(batch["text_enc"], sentinels).any(dim=1)[has_text].all()
    assert valid is not None and test is not None


def test_permutation_with_geometric_span_lengths_is_a_one_line_config_error(tmp_path: Path) -> None:
    cfg = small_t5_run(tmp_path)
    cfg.dataset.masking_do_permutation = True
    with pytest.raises(ConfigError, match=r"^dataset.masking_do_permutation=True with dataset.masking_use_geometric_"
                                          r"distribution=True: [^\n]*$"):
        cfg.validate()
    cfg = small_t5_run(tmp_path)
    cfg.dataset.masking_do_permutation, cfg.dataset.masking_use_geometric_distribution = True, False
    cfg.validate()


def test_t5_data_needs_a_t5_model_and_matching_lengths(tmp_path: Path) -> None:
    cfg = small_t5_run(tmp_path)
    cfg.dataset.sequence_length_decoder = 16
    cfg.validate()
    tokenizer = build_tokenizer(cfg.tokenizer)
    try:
        build_train_valid_test_data_iterators(cfg, TrainState(), tokenizer)
    except DataError as exc:
        assert "sequence_length_decoder=16" in str(exc) and "seq_length_dec=32" in str(exc)
    else:
        raise AssertionError("a decoder length mismatch must be a DataError")


def test_recipe_builds_a_t5_model() -> None:
    cfg = get_recipe("tiny-t5")
    cfg.model.vocab_size = 4096 + 1 + 100
    cfg.model.finalize()
    model = cfg.model.provide_meta()
    assert isinstance(model, T5Model) and model.vocab_size == 4224
    assert len(model.encoder.layers) == 2 and len(model.decoder.layers) == 2


@pytest.mark.slow
def test_trained_checkpoint_exports_to_transformers(tmp_path: Path) -> None:
    """`longspan convert export` of a tiny-t5 checkpoint gives a T5ForConditionalGeneration with our logits."""
    import transformers

    from longspan.cli import main
    from longspan.training.checkpointing.model_loading import load_model_from_checkpoint

    cfg = small_t5_run(tmp_path, "export", train_iters=3, eval_interval=None, eval_iters=0)
    pretrain(cfg)
    out = tmp_path / "hf"
    assert main(["convert", "export", "--checkpoint", cfg.checkpoint.save, "--output", str(out), "--no-progress"]) == 0
    hf = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
    assert hf.config.vocab_size == 533 and hf.config.num_decoder_layers == 2
    model = load_model_from_checkpoint(cfg.checkpoint.save).model[0]
    g = torch.Generator().manual_seed(0)
    enc, dec = torch.randint(0, 533, (2, 21), generator=g), torch.randint(0, 533, (2, 11), generator=g)
    with torch.no_grad():
        want = hf(input_ids=enc, decoder_input_ids=dec).logits
        got = model(enc, dec)[..., :533]
    assert (got - want).abs().max().item() <= 1e-5


def _hf_t5_dir(tmp_path: Path, vocab: int):
    import transformers

    config = transformers.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
                                   num_heads=4, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                                   tie_word_embeddings=False, dropout_rate=0.0, decoder_start_token_id=0)
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    return hf, tmp_path / "hf"


def test_finetuning_from_an_hf_t5_starts_at_transformers_loss(tmp_path: Path) -> None:
    """checkpoint.pretrained_checkpoint = an HF T5 directory: architecture from config.json (the recipe keeps
    its encoder/decoder lengths), HF weights loaded; the first logged loss equals transformers' on the same
    microbatches."""
    from longspan.training.finetune import finetune
    from longspan.training.step.t5_forward_step import t5_forward_step

    hf, hf_dir = _hf_t5_dir(tmp_path, vocab=533)  # the recipe tokenizer's size (bytes, <bos>, 20 sentinels)
    cfg = small_t5_run(tmp_path, "ft", train_iters=1, eval_interval=None, eval_iters=0)
    cfg.checkpoint.pretrained_checkpoint, cfg.checkpoint.load = str(hf_dir), None
    cfg.optimizer.lr = cfg.optimizer.min_lr = 0.0
    cfg.scheduler.lr_warmup_iters = 0
    batches: list = []

    def recording_step(state, data_iterator, model):
        def tee():
            batch = next(data_iterator)
            batches.append(batch)
            yield batch
        return t5_forward_step(state, tee(), model)

    finetune(cfg, recording_step)
    assert (cfg.model.num_layers, cfg.model.encoder_num_layers, cfg.model.seq_length_dec) == (3, 2, 32)
    total, count = 0.0, 0.0
    with torch.no_grad():
        assert len(batches) == 4  # 8 samples in microbatches of 2
        for b in batches:
            logits = hf(input_ids=b["text_enc"], attention_mask=b["enc_mask"], decoder_input_ids=b["text_dec"],
                        decoder_attention_mask=b["dec_mask"]).logits
            labels = torch.where(b["loss_mask"] > 0, b["labels"], 0)
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
            total += float((ce * b["loss_mask"].flatten()).sum())
            count += float(b["loss_mask"].sum())
    assert abs(losses_by_iteration(cfg)[1] - total / count) <= 1e-5


def test_hf_t5_directory_needs_a_t5_recipe(tmp_path: Path) -> None:
    from longspan.core.errors import ConfigError
    from longspan.training.checkpointing.hf_weights import apply_hf_pretrained_config

    _, hf_dir = _hf_t5_dir(tmp_path, vocab=533)
    cfg = get_recipe("tiny")
    cfg.checkpoint.pretrained_checkpoint = str(hf_dir)
    try:
        apply_hf_pretrained_config(cfg)
    except ConfigError as exc:
        assert "T5ModelProvider" in str(exc) and "GPTModelProvider" in str(exc) and "\n" not in str(exc)
    else:
        raise AssertionError("a GPT recipe with an HF T5 directory must be a ConfigError")


def test_convert_import_and_export_of_an_hf_t5_is_bit_exact(tmp_path: Path) -> None:
    """Importing an HF T5 (``AutoBridge.import_ckpt``, what `longspan convert import` runs) writes a T5
    checkpoint from config.json alone; exporting it gives back every tensor bit for bit."""
    import safetensors.torch

    from longspan import AutoBridge
    from longspan.models import T5ModelProvider
    from longspan.training.config import ConfigContainer

    _, hf_dir = _hf_t5_dir(tmp_path, vocab=533)
    ckpt, out = tmp_path / "ckpt", tmp_path / "back"
    AutoBridge.import_ckpt(hf_dir, ckpt, ["model.seq_length_dec=64"])
    saved = ConfigContainer.from_yaml(str(next(ckpt.glob("iter_*")) / "run_config.yaml"))
    assert isinstance(saved.model, T5ModelProvider) and saved.model.seq_length_dec == 64  # the override
    assert saved.model.num_layers == 3 and saved.model.encoder_num_layers == 2
    assert saved.model.gated_linear_unit and saved.tokenizer.vocab_extra_ids == 0
    AutoBridge.export_checkpoint(ckpt, out)
    original = safetensors.torch.load_file(str(hf_dir / "model.safetensors"))
    back = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert set(back) == set(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
