"""Train/validation/test datasets of a ``DirectHFSFTDatasetConfig`` (Megatron Bridge's direct HF SFT data).

Every source is read (``longspan.data.sft.hf_source``), adapted to canonical records
(``longspan.data.sft.schemas``) and tokenized once, at build time, so a bad row, a conversation with no
assistant turn or a template that cannot render stops the run before its first step with file, row and
reason. Chat records go through ``ChatFormatter`` (chat template, loss on the turns ``preprocessing.loss_mode``
names); plain-text records are tokenized as they are, with EOS, every token trained on. Records longer than
``seq_length + 1`` ids are cut at the end; the start-up summary counts them.

Sample order: sample ``i`` is a pure function of ``i`` (Megatron's samplers resume from
``consumed_train_samples``). One source walks its rows epoch after epoch, each epoch a permutation seeded by
``(blend_seed, epoch)``. Several sources: sample ``i`` goes to the source furthest below its share
``source_weights`` (normalized) so far (Megatron's blending rule, exact to one sample at every prefix); each
source then walks its own seeded epochs. Validation and test read their rows in order.

Batches are those of ``SFTDataset``: right padding to ``seq_length`` (``pad_to_max_length``) or to the longest
sample rounded up to ``pad_to_multiple_of``; no attention mask. With ``enable_in_batch_packing`` the samples of a
microbatch are packed into one sequence instead (``longspan.data.sft.in_batch_packing``; with images,
``longspan.data.sft.multimodal_packing``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from longspan.config.rules.data_hf import DEFERRED_IMAGE_PACKING
from longspan.config.schema.data_hf import DirectHFSFTDatasetConfig, HFDatasetSourceConfig
from longspan.core.errors import DataError, LongspanError, NotSupportedError
from longspan.core.logging import get_logger, print_rank_0
from longspan.data.sft.dataset import EpochSampleMap, SFTDataset, pad_token_id
from longspan.data.sft.formatting import ChatFormatter, SFTFormatOptions, tokenizer_chat_template
from longspan.data.sft.hf_source import MissingSplitError, describe_source, load_source_records
from longspan.data.sft.in_batch_packing import InBatchPacking, pack_rows
from longspan.data.sft.multimodal import (
    MultimodalChatFormatter,
    MultimodalDocument,
    MultimodalSFTDataset,
    load_processor,
)
from longspan.data.sft.multimodal_packing import InBatchPackedMultimodalDataset

logger = get_logger(__name__)

Document = tuple[np.ndarray, np.ndarray]


class BlendSampleMap:
    """Sample index -> record index over several sources: each sample goes to the source furthest below its
    weight's share so far; within a source, epochs of permutations seeded by ``(seed, source, epoch)``."""

    def __init__(self, sizes: list[int], offsets: list[int], weights: list[float], num_samples: int,
                 seed: int) -> None:
        total = float(sum(weights))
        shares = [w / total for w in weights]
        counts = [0] * len(sizes)
        source_of = np.empty(num_samples, dtype=np.int32)
        position = np.empty(num_samples, dtype=np.int64)
        for i in range(num_samples):
            s = max(range(len(shares)), key=lambda k: shares[k] * (i + 1) - counts[k])
            source_of[i], position[i] = s, counts[s]
            counts[s] += 1
        self.sizes, self.offsets, self.seed = sizes, offsets, seed
        self.source_of, self.position = source_of, position
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.source_of)

    def _order(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._orders:
            if len(self._orders) > 64:
                self._orders.clear()
            self._orders[key] = np.random.default_rng([self.seed, source, epoch]).permutation(self.sizes[source])
        return self._orders[key]

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        s = int(self.source_of[i])
        epoch, k = divmod(int(self.position[i]), self.sizes[s])
        return self.offsets[s] + int(self._order(s, epoch)[k])


class TokenizedSFTDataset(SFTDataset):
    """Pre-tokenized records with ``SFTDataset``'s samples and batches (packed per microbatch with ``packing``)."""

    def __init__(self, docs: list[Document], seq_length: int, opts: SFTFormatOptions, pad_id: int,
                 samples: Any, packing: Optional[InBatchPacking] = None) -> None:
        self.docs, self.seq_length, self.opts, self.pad_id, self.samples = docs, seq_length, opts, pad_id, samples
        self.packing = packing

    def document(self, item: int) -> Document:
        return self.docs[item]

    def collate_fn(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``SFTDataset``'s padded microbatch, or its samples packed into one sequence (``packing``); deferred
        packing pads and adds each sample's ``sequence_lengths`` for the training step to pack."""
        if self.packing is None:
            return super().collate_fn(samples)
        if self.packing.deferred:
            batch = super().collate_fn(samples)
            batch["sequence_lengths"] = torch.tensor([s["tokens"].numel() for s in samples], dtype=torch.long)
            return batch
        return pack_rows(samples, self.pad_id, self.packing.pad_to_multiple_of)


def in_batch_packing(dataset_cfg: DirectHFSFTDatasetConfig) -> Optional[InBatchPacking]:
    """The in-batch packing of a DirectHFSFTDatasetConfig, or None when it is off."""
    if not dataset_cfg.enable_in_batch_packing:
        return None
    return InBatchPacking(int(dataset_cfg.in_batch_packing_pad_to_multiple_of),
                          bool(dataset_cfg.defer_in_batch_packing_to_step))


def format_options(dataset_cfg: DirectHFSFTDatasetConfig) -> SFTFormatOptions:
    """The formatting options of a DirectHFSFTDatasetConfig (chat records, its padding and loss mode)."""
    loss_mode = dataset_cfg.preprocessing.loss_mode
    return SFTFormatOptions(
        answer_only_loss=True, pad_to_max_length=bool(dataset_cfg.pad_to_max_length),
        pad_seq_length_to_mult=int(dataset_cfg.pad_to_multiple_of), chat=True, messages_key="messages",
        loss_mode=loss_mode,
    )


class _Tokenizer:
    """Canonical records -> (ids, in_loss), untruncated (the caller cuts and counts)."""

    multimodal = None

    def __init__(self, tokenizer: Any, opts: SFTFormatOptions, chat_template: Optional[str]) -> None:
        self.tokenizer = tokenizer
        self.chat = ChatFormatter(tokenizer, chat_template or tokenizer_chat_template(tokenizer), opts, 1 << 62)
        eos = getattr(tokenizer, "eos", None)
        self.eos = eos if eos is not None else getattr(tokenizer, "eod", None)

    def __call__(self, record: dict[str, Any], where: str) -> Document:
        if "messages" in record:
            return self.chat(record, where)
        ids = list(self.tokenizer.tokenize(record["text"])) + ([self.eos] if self.eos is not None else [])
        return np.asarray(ids, dtype=np.int64), np.ones(len(ids), dtype=np.int8)


class _ProcessorTokenizer:
    """Canonical records -> ``MultimodalDocument`` through the HF processor of ``hf_processor_path`` (chat
    records with or without images; plain text through its tokenizer, every token trained on, with EOS)."""

    def __init__(self, processor: Any, opts: SFTFormatOptions, max_ids: int, chat_template: Optional[str]) -> None:
        self.multimodal = MultimodalChatFormatter(processor, opts, max_ids, None, chat_template)
        self.max_ids = max_ids

    def __call__(self, record: dict[str, Any], where: str, base_dir: Optional[str]) -> MultimodalDocument:
        if "messages" in record:
            return self.multimodal(record, where, base_dir)
        tok = self.multimodal.processor.tokenizer
        ids = list(tok(record["text"], add_special_tokens=False)["input_ids"])
        ids += [tok.eos_token_id] if tok.eos_token_id is not None else []
        cut = len(ids) > self.max_ids
        ids = ids[: self.max_ids]
        return MultimodalDocument(np.asarray(ids, dtype=np.int64), np.ones(len(ids), dtype=np.int8), [],
                                  record["text"], where, cut)


def _source_dir(source: Any) -> Optional[str]:
    """Where relative image paths of a source are read from: its file's directory, or its directory."""
    path = os.path.expanduser(str(source.path_or_dataset))
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path))
    files = (source.load_kwargs or {}).get("data_files")
    if isinstance(files, str) and os.path.isfile(files):
        return os.path.dirname(os.path.abspath(files))
    return os.path.abspath(path) if os.path.isdir(path) else None


def _tokenize_source(source: Any, split: str, tokenize: Any, max_ids: int) -> tuple[list[Any], int]:
    """The documents of one source split and how many were cut to ``max_ids``."""
    where = describe_source(source)
    docs, cut = [], 0
    if tokenize.multimodal is not None:
        base_dir = _source_dir(source)
        for row, record in enumerate(load_source_records(source, split)):
            doc = tokenize(record, f"{where} row {row}", base_dir)
            if len(doc.ids) < 2:
                raise DataError(f"{where} row {row}: the record gives {len(doc.ids)} token(s); a sample needs at least 2")
            docs.append(doc)
            cut += int(doc.cut)
        return docs, cut
    for row, record in enumerate(load_source_records(source, split)):
        ids, in_loss = tokenize(record, f"{where} row {row}")
        if len(ids) > max_ids:
            ids, in_loss, cut = ids[:max_ids], in_loss[:max_ids], cut + 1
        if len(ids) < 2:
            raise DataError(f"{where} row {row}: the record gives {len(ids)} token(s); a sample needs at least 2")
        docs.append((ids, in_loss))
    return docs, cut


def _rank_zero_first(build: Callable[[], Any]) -> Any:
    """Run ``build`` on rank 0 first (it fills the ``datasets`` cache), then on the other ranks; an error on
    rank 0 stops every rank with the same line instead of leaving them waiting."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return build()
    error: list[Optional[str]] = [None]
    result = None
    if dist.get_rank() == 0:
        try:
            result = build()
        except LongspanError as exc:
            error = [str(exc)]
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise DataError(error[0])
    return result if dist.get_rank() == 0 else build()


def _split_source(dataset_cfg: DirectHFSFTDatasetConfig, split: str) -> Optional[HFDatasetSourceConfig]:
    """An explicit validation/test source reads its own split ('train' when unset, as any source); without
    one, the single training source's split named ``split``."""
    explicit = dataset_cfg.validation_source if split == "validation" else dataset_cfg.test_source
    if explicit is not None:
        return explicit if explicit.split else dataclasses.replace(explicit, split="train")
    sources = dataset_cfg.training_sources
    return dataclasses.replace(sources[0], split=split) if len(sources) == 1 else None


def _cut_note(cut: int, seq_length: int) -> str:
    """How many rows were cut, in the user's unit: a row of seq_length + 1 tokens still fits whole (its first
    seq_length tokens are the inputs, its last is only the final input's label)."""
    return (f"{cut} longer than seq_length={seq_length} cut at the end (a sample holds {seq_length + 1} tokens: "
            f"{seq_length} inputs, each labelled with the next)")


def _train_dataset(dataset_cfg: DirectHFSFTDatasetConfig, tokenize: Any, seq_length: int, opts: SFTFormatOptions,
                   pad_id: int, needed: int) -> TokenizedSFTDataset:
    sources = dataset_cfg.training_sources
    docs: list[Document] = []
    sizes, offsets = [], []
    for source in sources:
        source_docs, cut = _tokenize_source(source, source.split or "train", tokenize, seq_length + 1)
        offsets.append(len(docs))
        sizes.append(len(source_docs))
        docs.extend(source_docs)
        print_rank_0(f"direct HF SFT data, train: {len(source_docs)} rows of {describe_source(source)}; "
                     f"{_cut_note(cut, seq_length)}", logger)
    seed = int(dataset_cfg.blend_seed)
    if len(sources) == 1 and dataset_cfg.source_weights is None:
        samples: Any = EpochSampleMap(len(docs), needed, seed, shuffle=True)
    else:
        weights = list(dataset_cfg.source_weights or [1.0] * len(sources))
        samples = BlendSampleMap(sizes, offsets, weights, needed, seed)
    return _dataset(docs, tokenize, seq_length, opts, pad_id, samples, in_batch_packing(dataset_cfg))


def _dataset(docs: list[Any], tokenize: Any, seq_length: int, opts: SFTFormatOptions, pad_id: int,
             samples: Any, packing: Optional[InBatchPacking]) -> torch.utils.data.Dataset:
    if tokenize.multimodal is not None:
        if packing is not None and packing.deferred:
            raise NotSupportedError(DEFERRED_IMAGE_PACKING)
        if packing is not None:
            return InBatchPackedMultimodalDataset(docs, tokenize.multimodal, seq_length, opts, pad_id, samples,
                                                  pad_to_multiple_of=packing.pad_to_multiple_of)
        return MultimodalSFTDataset(docs, tokenize.multimodal, seq_length, opts, pad_id, samples)
    return TokenizedSFTDataset(docs, seq_length, opts, pad_id, samples, packing)


def _eval_dataset(dataset_cfg: DirectHFSFTDatasetConfig, split: str, tokenize: Any, seq_length: int,
                  opts: SFTFormatOptions, pad_id: int, needed: int) -> Optional[TokenizedSFTDataset]:
    source = _split_source(dataset_cfg, split)
    if source is None:
        print_rank_0(f"direct HF SFT data: no {split} source for a blend: the {split} split is skipped", logger)
        return None
    try:
        docs, cut = _tokenize_source(source, source.split, tokenize, seq_length + 1)
    except MissingSplitError as exc:
        if split == "test" and dataset_cfg.test_source is None:
            print_rank_0(f"direct HF SFT data: {exc}; the test split is skipped", logger)
            return None
        field = "validation_source" if split == "validation" else "test_source"
        raise DataError(f"{exc}: set dataset.{field} or dataset.do_{split}=False") from None
    print_rank_0(f"direct HF SFT data, {split}: {len(docs)} rows of {describe_source(source)}; "
                 f"{_cut_note(cut, seq_length)}", logger)
    samples = EpochSampleMap(len(docs), max(needed, len(docs)), int(dataset_cfg.blend_seed), shuffle=False)
    return _dataset(docs, tokenize, seq_length, opts, pad_id, samples, in_batch_packing(dataset_cfg))


def build_direct_hf_sft_datasets(
    dataset_cfg: DirectHFSFTDatasetConfig, tokenizer: Any, sizes: tuple[int, int, int], seq_length: int,
    chat_template: Optional[str] = None,
) -> list[Optional[torch.utils.data.Dataset]]:
    """[train, validation, test] datasets of a DirectHFSFTDatasetConfig (None for a split not built).

    ``sizes`` are the samples the run needs per split (Megatron's train/valid/test numbers).
    """
    opts = format_options(dataset_cfg)
    tokenize: Any = _Tokenizer(tokenizer, opts, chat_template)
    if dataset_cfg.hf_processor_path is not None:
        processor = load_processor(str(dataset_cfg.hf_processor_path), dataset_cfg.hf_processor_kwargs)
        tokenize = _ProcessorTokenizer(processor, opts, seq_length + 1, chat_template)
    pad_id = pad_token_id(tokenizer)
    train_needed, valid_needed, test_needed = sizes

    def build() -> list[Optional[torch.utils.data.Dataset]]:
        out: list[Optional[torch.utils.data.Dataset]] = [
            _train_dataset(dataset_cfg, tokenize, seq_length, opts, pad_id, train_needed) if train_needed > 0 else None]
        for split, wanted, needed in (("validation", dataset_cfg.do_validation, valid_needed),
                                      ("test", dataset_cfg.do_test, test_needed)):
            out.append(_eval_dataset(dataset_cfg, split, tokenize, seq_length, opts, pad_id, needed)
                       if wanted and needed > 0 else None)
        return out

    return _rank_zero_first(build)
