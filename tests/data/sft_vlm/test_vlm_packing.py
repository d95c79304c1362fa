"""Multimodal sequence packing (``dataset.packed_sequence_specs`` with a vision-language model's processor): each
conversation's loss in a pack is the loss it has alone.

For Qwen2.5-VL, Qwen3-VL (DeepStack, interleaved mRoPE), Qwen3.5-VL (gated DeltaNet layers: their state restarts
at each document), Gemma 3 and Gemma 4 with images (two-way image attention), conversations with images of
different sizes and text-only ones are packed (several per pack, two or more packs per microbatch, each padded to a
multiple of 4) and run through the training forward step: every conversation's per-token losses and Σ loss equal
those it has run alone through the same step (fp32), and the packs' Σ loss has the gradients of the
conversations' Σ loss alone. They differ when a document sees another (mask) or when an image goes to another
document (pixel order); the position ids of each packed document are checked to be exactly those it has alone (a
uniform shift of a document's positions would leave RoPE's losses as they are).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.data.sft_vlm.conftest import qwen_colour_rows, write_jsonl
from tests.data.sft_vlm.gemma_fixtures import gemma_colour_rows, make_gemma4_vl_dir, make_gemma_vl_dir

ROWS = 6  # images of 3 sizes on 4 of them, 2 without an image
TOL = 2e-5


def _qwen_rows(root: Path) -> list[dict]:
    return qwen_colour_rows(str(root), ROWS, seed=3, text_only=lambda i: i in (2, 4),
                            text_only_question="what colour is the square")


def _qwen25(hf: Path) -> None:
    from tests.models.vlm.qwen_vl_fixtures import make_qwen_vl

    make_qwen_vl(hf)


def _qwen3(hf: Path) -> None:
    from tests.models.vlm.qwen3_vl_fixtures import make_qwen3_vl

    make_qwen3_vl(hf)


def _qwen35(hf: Path) -> None:
    from tests.models.vlm.qwen3_vl_fixtures import make_qwen35_vl

    make_qwen35_vl(hf)


def _gemma3(hf: Path) -> None:
    make_gemma_vl_dir(hf)


def _gemma4(hf: Path) -> None:
    make_gemma4_vl_dir(hf)


MODELS = {"qwen2.5-vl": (_qwen25, _qwen_rows), "qwen3-vl": (_qwen3, _qwen_rows), "qwen3.5-vl": (_qwen35, _qwen_rows),
          "gemma3-vl": (_gemma3, lambda root: gemma_colour_rows(str(root), ROWS, seed=3, text_only_every=3)),
          "gemma4-vl": (_gemma4, lambda root: gemma_colour_rows(str(root), ROWS, seed=3, text_only_every=3))}


class _Timers:
    def __call__(self, *args, **kwargs) -> "_Timers":
        return self

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def _step(provider, model, batch: dict, packed: int | None, grad: bool = False, dataset=None) -> torch.Tensor:
    """Per-token losses of one microbatch through the training forward step (packed: the pack size; ``dataset``:
    another dataset config)."""
    from longspan.training.config import FinetuningDatasetConfig, PackedSequenceSpecs
    from longspan.training.step.forward_step import forward_step

    specs = PackedSequenceSpecs(packed_sequence_size=packed) if packed else None
    dataset = dataset or FinetuningDatasetConfig(dataset_root="unused", packed_sequence_specs=specs)
    state = SimpleNamespace(cfg=SimpleNamespace(model=provider, dataset=dataset), timers=_Timers(),
                            device=torch.device("cpu"), tokenizer=None)
    with torch.set_grad_enabled(grad):
        output, _ = forward_step(state, iter([batch]), model)
    return output


@pytest.fixture(scope="module", params=sorted(MODELS))
def packed_case(request, tmp_path_factory):
    """(provider, model, packed dataset, one dataset per conversation) of one model family."""
    from longspan.conversion import AutoBridge
    from longspan.data.sft.dataset import EpochSampleMap
    from longspan.data.sft.formatting import SFTFormatOptions
    from longspan.data.sft.multimodal import build_multimodal_jsonl_split, load_processor
    from longspan.data.sft.multimodal_packing import build_multimodal_packed_split
    from longspan.training.config import PackedSequenceSpecs

    make, rows = MODELS[request.param]
    root = tmp_path_factory.mktemp(f"pack-{request.param}")
    hf, data = root / "hf", root / "data"
    hf.mkdir()
    make(hf)
    path = write_jsonl(str(data / "training.jsonl"), rows(data))
    processor = load_processor(str(hf))
    in_order = lambda n: EpochSampleMap(n, n, 0, False)  # noqa: E731
    alone = build_multimodal_jsonl_split(path, processor, SFTFormatOptions(), 256, in_order, 0)
    lengths = sorted(len(doc.ids) - 1 for doc in alone.docs)
    size = -(-(lengths[-1] + lengths[-2] + 8) // 8) * 8  # the two longest fit one pack (with padding to 4)
    specs = PackedSequenceSpecs(packed_sequence_size=size, pad_seq_to_mult=4)
    packed = build_multimodal_packed_split(path, processor, SFTFormatOptions(), size, specs, in_order, 0, seed=0)
    bridge = AutoBridge.from_hf_pretrained(str(hf))
    model = bridge.to_megatron_model()[0].eval()
    return request.param, bridge.to_megatron_provider(), model, packed, alone


def _image_docs(ds, members) -> int:
    return sum(bool(ds.docs[d].images) for d in members)


def test_each_packed_conversation_has_the_loss_it_has_alone(packed_case):
    name, provider, model, packed, alone = packed_case
    assert len(packed.packs) >= 2 and max(_image_docs(packed, m) for m in packed.packs) >= 2, packed.packs
    batch = packed.collate_fn([packed[i] for i in range(len(packed))])  # every pack: one microbatch
    losses = _step(provider, model, batch, packed.pack_size)
    seen = 0
    for row, members in enumerate(packed.packs):
        cu = batch["cu_seqlens"][row].tolist()
        for number, d in enumerate(members):
            single = alone.collate_fn([alone[d]])
            expected = _step(provider, model, single, None)[0]
            n = alone[d]["tokens"].numel()
            start = cu[number]
            got = losses[row, start: start + n]
            mask, expected = single["loss_mask"][0, :n], expected[:n]
            assert torch.equal(batch["loss_mask"][row, start: start + n], mask)
            torch.testing.assert_close(got * mask, expected * mask, rtol=TOL, atol=TOL, msg=f"{name} document {d}")
            torch.testing.assert_close((got * mask).sum(), (expected * mask).sum(), rtol=TOL, atol=TOL)
            seen += 1
    assert seen == len(alone.docs)


def _gradients(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_the_packed_loss_sum_has_the_gradients_of_the_conversations_alone(packed_case):
    """Σ loss of the packs and Σ of the conversations' losses alone: equal, with equal gradients of every
    parameter (the vision encoder's and projector's included: each image reaches its own conversation)."""
    name, provider, model, packed, alone = packed_case
    batch = packed.collate_fn([packed[i] for i in range(len(packed))])
    packed_loss = (_step(provider, model, batch, packed.pack_size, grad=True) * batch["loss_mask"]).sum()
    packed_grads = _gradients(model, packed_loss)
    alone_loss = 0.0
    for d in range(len(alone.docs)):
        single = alone.collate_fn([alone[d]])
        alone_loss = alone_loss + (_step(provider, model, single, None, grad=True) * single["loss_mask"]).sum()
    alone_grads = _gradients(model, alone_loss)
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(packed_loss.detach(), alone_loss.detach(), rtol=TOL, atol=TOL)
    assert packed_grads.keys() == alone_grads.keys() and any("vision" in k for k in packed_grads), name
    for key, grad in packed_grads.items():  # fp32 rounding, relative to the gradient's norm (a key bias's is ~0)
        difference = float((grad - alone_grads[key]).norm())
        assert difference <= 1e-5 * float(alone_grads[key].norm()) + 1e-6, (name, key, difference)


def test_each_packed_conversation_is_numbered_as_alone(packed_case):
    name, provider, _, packed, alone = packed_case
    sample = packed[0]
    batch = packed.collate_fn([sample])
    if "image_grid_thw" in batch:  # mRoPE: the provider numbers each document's images and text from 0
        positions = provider.image_position_ids(batch["tokens"], batch["image_grid_thw"], cu_seqlens=batch["cu_seqlens"])
    else:
        positions = batch["position_ids"]
    cu = batch["cu_seqlens"][0].tolist()
    for number, d in enumerate(packed.packs[0]):
        single = alone.collate_fn([alone[d]])
        n = alone[d]["tokens"].numel()
        if "image_grid_thw" in single:
            own = provider.image_position_ids(single["tokens"], single["image_grid_thw"])
        else:
            own = single["position_ids"]
        if positions.dim() == 3 and own.dim() == 2:  # a text-only document of an mRoPE model: same on all axes
            own = own.unsqueeze(0).expand(3, -1, -1)
        assert torch.equal(positions[..., 0, cu[number]: cu[number] + n], own[..., 0, :n]), (name, number)


def test_in_batch_packing_gives_each_conversation_the_loss_it_has_alone(packed_case):
    """``enable_in_batch_packing`` of the direct HF SFT data with ``hf_processor_path``: the microbatch's samples
    (with their images, each padded to a multiple of 4) in one ``[1, T]`` sequence."""
    from longspan.data.sft.multimodal_packing import InBatchPackedMultimodalDataset
    from longspan.training.config import DirectHFSFTDatasetConfig

    name, provider, model, _, alone = packed_case
    in_batch = InBatchPackedMultimodalDataset(alone.docs, alone.formatter, alone.seq_length, alone.opts, 0,
                                              alone.samples, pad_to_multiple_of=4)
    batch = in_batch.collate_fn([in_batch[d] for d in range(len(alone.docs))])
    assert batch["tokens"].shape[0] == 1 and batch["tokens"].shape[1] % 4 == 0
    losses = _step(provider, model, batch, None, dataset=DirectHFSFTDatasetConfig(
        seq_length=256, source="unused", enable_in_batch_packing=True))[0]
    starts = batch["cu_seqlens"][0].tolist()
    for d, start in enumerate(starts[:-1]):
        single = alone.collate_fn([alone[d]])
        n = alone[d]["tokens"].numel()
        mask = single["loss_mask"][0, :n]
        expected = _step(provider, model, single, None)[0, :n]
        torch.testing.assert_close(losses[start: start + n] * mask, expected * mask, rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{name} document {d}: {m}")


def test_image_blocks_never_reach_into_another_document():
    """Two documents whose image tokens touch at the boundary: the two-way image block stays in each one."""
    from longspan.data.sft.packing import document_layout
    from longspan.families.gemma_vl.model import image_attention_mask

    doc = torch.tensor([0, 0, 0, 1, 1, 1])
    types = torch.tensor([[0, 1, 1, 1, 1, 0]])
    _, mask, _ = document_layout(doc)
    blocks = image_attention_mask(types, mask[None, None]).mask[0, 0]
    apart = doc[:, None] != doc[None, :]
    assert bool(blocks[apart].all())  # nothing across the documents
    assert not bool(blocks[1, 2]) and not bool(blocks[3, 4])  # each document's image sees itself both ways


def test_multimodal_packs_refuse_packed_file_paths(tmp_path):
    from longspan.core.errors import NotSupportedError
    from longspan.data.sft.multimodal_packing import check_multimodal_packing
    from longspan.training.config import PackedSequenceSpecs

    with pytest.raises(NotSupportedError, match="packed_train_data_path"):
        check_multimodal_packing(PackedSequenceSpecs(packed_sequence_size=64,
                                                     packed_train_data_path=str(tmp_path / "p.npy")))


@pytest.mark.slow
def test_the_vlm_recipe_packs_from_packed_sequence_specs_and_logs_more_tokens_per_step(tmp_path):
    """``vlm-sft`` with ``dataset.packed_sequence_specs.packed_sequence_size``: two steps of packed microbatches
    train on several conversations each (the logged tokens and loss tokens per step), where the same batch sizes
    unpacked train on one conversation per microbatch."""
    import math

    from longspan.recipes.loading import load_config
    from longspan.training.finetune import finetune
    from tests.models.vlm.qwen_vl_fixtures import make_qwen_vl
    from tests.training.pretrain_helpers import read_metrics

    hf, data = tmp_path / "hf", tmp_path / "data"
    hf.mkdir()
    make_qwen_vl(hf)
    write_jsonl(str(data / "training.jsonl"), _qwen_rows(data) * 2)
    records = {}
    for packed in (False, True):
        out = tmp_path / ("packed" if packed else "plain")
        overrides = [f"checkpoint.pretrained_checkpoint={hf}", f"dataset.dataset_root={data}", "checkpoint.save=null",
                     "checkpoint.load=null", f"logger.tensorboard_dir={out}/tb", "logger.log_interval=1",
                     "train.train_iters=2", "train.eval_iters=0", "train.global_batch_size=2",
                     "train.micro_batch_size=1", "scheduler.lr_warmup_iters=0", "dataset.do_validation=false"]
        overrides += (["model.seq_length=96", "dataset.packed_sequence_specs.packed_sequence_size=96"] if packed
                      else ["model.seq_length=48"])
        cfg = load_config("vlm-sft", overrides=overrides)
        finetune(cfg)
        records[packed] = read_metrics(cfg)
    for plain, packed in zip(records[False], records[True]):
        assert math.isfinite(packed["losses"]["lm loss"])
        assert packed["tokens"] > 2 * plain["tokens"] and packed["loss_tokens"] > 2 * plain["loss_tokens"], (plain, packed)
