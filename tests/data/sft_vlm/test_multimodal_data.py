"""Multimodal chat SFT data: masks against transformers' assistant mask, pixel inputs aligned with the image tokens
through collation, the direct HF path with hf_processor_path / hf_processor_kwargs, and bad input in one line."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from longspan.config.schema.data import FinetuningDatasetConfig
from longspan.core.errors import DataError
from longspan.data.sft.dataset import build_sft_datasets
from longspan.data.sft.multimodal import MultimodalSFTDataset, load_processor
from tests.data.sft_vlm.conftest import colour_rows, draw_square, make_qwen_vl_processor_dir, write_jsonl

SEQ = 96


def _finetuning_cfg(root: str, **kwargs) -> FinetuningDatasetConfig:
    fields = dict(dataset_root=root, dataset_kwargs={"pad_to_max_length": False, "pad_seq_length_to_mult": 8},
                  seed=3, do_validation=False, do_test=False)
    return FinetuningDatasetConfig(**{**fields, **kwargs})


@pytest.fixture(scope="module")
def colour_data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("vlm-data"))
    rows = colour_rows(root, 6)
    write_jsonl(os.path.join(root, "training.jsonl"), rows)
    return root, rows


def _hf_oracle(processor_dir: str, root: str, messages: list) -> tuple[np.ndarray, np.ndarray]:
    """transformers' own ids and assistant mask ({% generation %} markers) for a conversation."""
    oracle = load_processor(processor_dir)
    absolute = [{**m, "content": [{**p, "image": os.path.join(root, p["image"])} if p.get("type") == "image" else p
                                  for p in m["content"]] if isinstance(m["content"], list) else m["content"]}
                for m in messages]
    out = oracle.apply_chat_template(absolute, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return np.asarray(out["input_ids"][0]), np.asarray(out["assistant_masks"][0])


def test_masks_are_the_assistant_tokens_and_pixels_follow_their_samples(colour_data, vl_processor_dir, vl_processor,
                                                                        tmp_path):
    """Loss masks equal transformers' assistant mask (image tokens never trained); a collated microbatch holds
    each sample's pixel patches in sample order, as many image tokens per sample as its grid says."""
    root, rows = colour_data
    marked = make_qwen_vl_processor_dir(str(tmp_path / "marked"), marked=True)
    train, _, _ = build_sft_datasets(_finetuning_cfg(root), _LongspanTok(vl_processor_dir), (6, 0, 0), SEQ,
                                     processor=vl_processor)
    assert isinstance(train, MultimodalSFTDataset)
    image_id = vl_processor.image_token_id
    for item, doc in enumerate(train.docs):
        ids, mask = _hf_oracle(marked, root, rows[item]["messages"])
        np.testing.assert_array_equal(doc.ids, ids)
        np.testing.assert_array_equal(doc.in_loss, mask)
        assert mask.sum() > 0 and not doc.in_loss[ids == image_id].any()
    samples = [train[i] for i in range(4)]
    batch = train.collate_fn(samples)
    merge = vl_processor.image_processor.merge_size
    expected_patches, grids = [], []
    for row, sample in enumerate(samples):
        doc = train.docs[train.samples[row]]
        image = vl_processor.image_processor(images=[_open(doc.images[0])], return_tensors="pt")
        expected_patches.append(image["pixel_values"])
        grids.append(image["image_grid_thw"])
        tokens = int((batch["tokens"][row] == image_id).sum())
        assert tokens == int(image["image_grid_thw"].prod()) // merge ** 2
        n = len(doc.ids) - 1
        assert batch["loss_mask"][row, n:].sum() == 0 and torch.equal(batch["tokens"][row, :n], torch.from_numpy(doc.ids[:-1]))
    assert torch.equal(batch["pixel_values"], torch.cat(expected_patches))
    assert torch.equal(batch["image_grid_thw"], torch.cat(grids))
    assert batch["tokens"].shape[1] % 8 == 0 and len({tuple(g.tolist()) for g in batch["image_grid_thw"]}) > 1


def _open(path: str):
    from PIL import Image

    return Image.open(path).convert("RGB")


def _hf_cfg(root: str, **kwargs):
    from longspan.config.schema.data_hf import DirectHFSFTDatasetConfig, HFDatasetSourceConfig

    return DirectHFSFTDatasetConfig(seq_length=SEQ, source=HFDatasetSourceConfig(
        path_or_dataset=os.path.join(root, "training.jsonl"), schema_adapter="messages"), do_validation=False,
        do_test=False, pad_to_multiple_of=8, **kwargs)


def test_direct_hf_path_reads_images_through_hf_processor_path(colour_data, vl_processor_dir, vl_processor):
    """hf_processor_path turns image rows into pixel inputs (without it they are a text-only model's error, one
    line naming the row); hf_processor_kwargs reach the image processor (fewer pixels, fewer image tokens)."""
    from longspan.data.sft.hf_dataset import build_direct_hf_sft_datasets

    root, _ = colour_data
    with pytest.raises(DataError, match=r"training.jsonl row 0: the conversation has images, but no image processor"):
        build_direct_hf_sft_datasets(_hf_cfg(root), _LongspanTok(vl_processor_dir), (4, 0, 0), SEQ)
    image_id = vl_processor.image_token_id
    counts = []
    for kwargs in (None, {"max_pixels": 28 * 28}):
        train, _, _ = build_direct_hf_sft_datasets(
            _hf_cfg(root, hf_processor_path=vl_processor_dir, hf_processor_kwargs=kwargs),
            _LongspanTok(vl_processor_dir), (4, 0, 0), SEQ)
        batch = train.collate_fn([train[i] for i in range(4)])
        assert batch["image_grid_thw"].shape == (4, 3)
        counts.append(int((batch["tokens"] == image_id).sum()))
        assert counts[-1] == int(batch["image_grid_thw"].prod(-1).sum()) // 4
    assert counts[1] == 4 < counts[0]


def _LongspanTok(path: str):
    from longspan.data.tokenizers import HuggingFaceTokenizer

    return HuggingFaceTokenizer(path)


def _bad_rows(root: str) -> dict[str, tuple[dict, str]]:
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    draw_square(os.path.join(root, "images", "ok.png"), "red", (28, 28))
    with open(os.path.join(root, "images", "broken.png"), "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n not really a png")

    def conv(content: list) -> dict:
        return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "red"}]}

    return {
        "missing": (conv([{"type": "image", "image": "images/none.png"}]), r"line 2: image .*none.png does not exist"),
        "unreadable": (conv([{"type": "image", "image": "images/broken.png"}]),
                       r"line 2: image .*broken.png cannot be read"),
        "count": (conv([{"type": "image", "image": "images/ok.png"}, {"type": "text", "text": "<|image_pad|> hi"}]),
                  r"line 2: the images do not match the text's image tokens"),
    }


@pytest.mark.parametrize("case", ["missing", "unreadable", "count"])
def test_bad_rows_stop_the_build_naming_file_and_line(tmp_path, vl_processor_dir, vl_processor, case):
    """A bad row anywhere stops the build (before any sample is read), naming the file, its line and why."""
    row, pattern = _bad_rows(str(tmp_path))[case]
    good = colour_rows(str(tmp_path), 1)[0]
    write_jsonl(str(tmp_path / "training.jsonl"), [good, row, good])
    with pytest.raises(DataError, match=pattern) as info:
        build_sft_datasets(_finetuning_cfg(str(tmp_path)), _LongspanTok(vl_processor_dir), (3, 0, 0), SEQ,
                           processor=vl_processor)
    assert "\n" not in str(info.value) and "training.jsonl" in str(info.value)


def test_images_for_a_text_only_model_are_one_line_errors(colour_data, tmp_path, vl_processor):
    """Without an image processor (a text-only model's tokenizer) an image row is refused naming its line.
    (Conversations without an image train under data parallel: tests/data/sft_vlm/test_gemma_vlm_finetune.py;
    packing multimodal data: tests/data/sft_vlm/test_vlm_packing.py.)"""
    from tests.data.sft.conftest import make_hf_tokenizer_dir

    root, _ = colour_data
    text_only = _LongspanTok(make_hf_tokenizer_dir(str(tmp_path / "text-tok")))
    train, _, _ = build_sft_datasets(_finetuning_cfg(root), text_only, (2, 0, 0), SEQ)
    with pytest.raises(DataError, match=r"training.jsonl line \d+: the conversation has images, but no image "
                                        r"processor formats the data \(a text-only model"):
        train[0]
