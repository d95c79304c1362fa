"""Supervised finetuning data: JSONL prompt/completion and chat records, loss masks, sequence packing.

May import: core, config, models (its own layer).
"""

from longspan.data.sft.dataset import (
    EpochSampleMap,
    PackedSFTDataset,
    SFTDataset,
    build_sft_datasets,
    pack_sft_dataset,
    prepare_packed_split,
)
from longspan.data.sft.formatting import SFTFormatOptions, parse_format_options
from longspan.data.sft.jsonl_index import JsonlIndex
from longspan.data.sft.packing import PackedSequenceSpecs, first_fit_decreasing, resolve_packed_specs

__all__ = [
    "EpochSampleMap", "JsonlIndex", "PackedSFTDataset", "PackedSequenceSpecs", "SFTDataset", "SFTFormatOptions",
    "build_sft_datasets", "first_fit_decreasing", "pack_sft_dataset", "parse_format_options", "prepare_packed_split",
    "resolve_packed_specs",
]
