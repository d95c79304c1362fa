"""Finetuning data as users hold it: Megatron Bridge's *direct Hugging Face SFT* configs.

``DirectHFSFTDatasetConfig`` (``megatron.bridge.data.builders.direct_hf_sft``) reads one or more
``HFDatasetSourceConfig`` sources (``megatron.bridge.data.sources.hf``) through ``datasets`` (local JSONL, JSON
arrays, Parquet, CSV, ``save_to_disk`` directories), turns each row into OpenAI-style messages with a schema
adapter (``longspan.data.sft.schemas``) and formats them with the chat template as
``ChatSFTPreprocessingConfig`` (``megatron.bridge.data.sft_processing``) says. Built by
``longspan.data.sft.hf_dataset``; checked by ``longspan.config.rules.data_hf``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from longspan.config.schema.data import DataloaderConfig

# Names ``schema_adapter`` accepts (the table of longspan.data.sft.schemas has exactly these keys).
SCHEMA_ADAPTERS = ("messages", "conversation", "sharegpt", "alpaca", "prompt_completion", "text")
LOSS_MODES = ("assistant", "last_turn", "full")


@dataclass(kw_only=True)
class HFDatasetSourceConfig:
    """One split of one dataset: a local file or directory (or, with a network, a Hub name) and how its rows
    become conversations."""

    dataset_name: Optional[str] = None
    """A named preset of Megatron Bridge (a Hub dataset with its own adapter); not supported yet: use
    path_or_dataset."""

    path_or_dataset: Optional[str] = None
    """A local .jsonl/.json/.parquet/.csv file, a ``datasets.save_to_disk`` directory, a directory of such
    files, a ``datasets`` builder name ('json', 'parquet', 'csv' with ``load_kwargs.data_files``), or a Hub
    dataset name (needs a network)."""

    split: Optional[str] = None
    """Split to read ('train', 'validation', slices such as 'train[:90%]'); None means 'train'."""

    subset: Optional[Union[str, list[str]]] = None
    """Dataset configuration name (``load_dataset``'s second argument); a list concatenates several."""

    load_kwargs: Optional[dict[str, Any]] = None
    """Extra ``datasets.load_dataset`` arguments, e.g. ``data_files`` (a path, a list, or split -> paths)."""

    schema_adapter: Optional[str] = None
    """How rows become messages: 'messages', 'conversation', 'sharegpt', 'alpaca', 'prompt_completion' or
    'text'; None detects it from the columns (when they are unambiguous)."""

    adapter_kwargs: Optional[dict[str, Any]] = None
    """Column renames for the adapter, e.g. {'messages_column': 'chat'}, {'instruction_column': 'q',
    'output_column': 'a'}, {'prompt_column': 'question', 'completion_column': 'answer'},
    {'system_prompt': '...'} (see longspan.data.sft.schemas)."""


@dataclass(kw_only=True)
class ChatSFTPreprocessingConfig:
    """How conversations become token ids and a loss mask (rendered with the chat template)."""

    loss_mode: Literal["assistant", "last_turn", "full"] = "assistant"
    """Tokens the loss covers: 'assistant' every assistant turn, 'last_turn' only the final assistant turn,
    'full' the whole rendered conversation."""


@dataclass(kw_only=True)
class DirectHFSFTDatasetConfig(DataloaderConfig):
    """Supervised finetuning data read through ``datasets`` from files as users hold them (Megatron Bridge's
    DirectHFSFTDatasetConfig); built by longspan.data.sft.hf_dataset."""

    seq_length: int
    """Tokens per sample (must equal model.seq_length); longer conversations are cut at the end and counted
    in the start-up summary."""

    source: Union[HFDatasetSourceConfig, list[HFDatasetSourceConfig]]
    """The training data: one source, or a list of sources blended by source_weights."""

    source_weights: Optional[list[float]] = None
    """With several sources: the share of the training samples each one gives (normalized); None gives each
    source the same share."""

    blend_seed: int = 1234
    """Seed of the training sample order (each source's epochs are seeded permutations)."""

    validation_source: Optional[HFDatasetSourceConfig] = None
    """The validation data (its split, 'train' when unset); None reads split 'validation' of the (single)
    training source."""

    test_source: Optional[HFDatasetSourceConfig] = None
    """The test data (its split, 'train' when unset); None reads split 'test' of the (single) training source
    when it has one."""

    preprocessing: ChatSFTPreprocessingConfig = field(default_factory=ChatSFTPreprocessingConfig)
    """How conversations are rendered and which tokens carry the loss."""

    hf_processor_path: Optional[str] = None
    """A model directory whose HF processor (image processor, tokenizer, chat template) formats the rows:
    multimodal conversations (``{"type": "image", "image": PATH}`` content parts) for vision-language models;
    None formats text conversations with the run's tokenizer."""

    hf_processor_kwargs: Optional[dict[str, Any]] = None
    """Extra ``AutoProcessor.from_pretrained`` arguments for hf_processor_path (e.g. image processor sizes)."""

    do_validation: bool = True
    """Build the validation split (when the run evaluates)."""

    do_test: bool = True
    """Build the test split (when the source has one or test_source is set)."""

    skip_getting_attention_mask_from_dataset: bool = True
    """Batches carry no attention mask (right padding under the causal mask cannot reach real tokens)."""

    dataloader_type: Optional[Literal["single", "cyclic", "external"]] = "cyclic"
    """'cyclic' reshuffles each epoch (Megatron Bridge's default here), 'single' reads in order."""

    enable_in_batch_packing: bool = False
    """Pack the samples of a microbatch into one ``[1, T]`` sequence (each padded to
    in_batch_packing_pad_to_multiple_of, positions restarting per sample, a block-diagonal causal mask and
    cu_seqlens), so no padding to the longest sample is computed; the loss sum and token count equal the unpacked
    microbatch's. Needs micro_batch_size >= 2 and pad_to_max_length=False; with hf_processor_path the images
    of the microbatch go with their samples (not with defer_in_batch_packing_to_step); not with pipeline or context
    parallel (variable-width packs are not built there)."""

    defer_in_batch_packing_to_step: bool = False
    """With enable_in_batch_packing: the collate function pads the microbatch (and records each sample's length)
    and the training step packs it, on the device, into the same batch the collate would have built."""

    pad_to_max_length: bool = False
    """Pad every microbatch to seq_length; False pads to the longest sample rounded up to pad_to_multiple_of
    (pipeline parallel needs True)."""

    pad_to_multiple_of: int = 128
    """With pad_to_max_length=False: microbatch lengths are multiples of this (capped at seq_length). In-batch
    packed microbatches are not padded by it (their samples use in_batch_packing_pad_to_multiple_of)."""

    in_batch_packing_pad_to_multiple_of: int = 1
    """With enable_in_batch_packing: each sample is padded to a multiple of this inside the pack (pad id, no
    loss, positions counting on); with sequence_parallel it must be a multiple of tensor_model_parallel_size
    (Bridge derives it from the layout; longspan checks the given value instead of replacing it)."""

    @property
    def training_sources(self) -> list[HFDatasetSourceConfig]:
        """The sources the training samples come from, blended or not."""
        return list(self.source) if isinstance(self.source, list) else [self.source]
