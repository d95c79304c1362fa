"""Data configs: dataloader, GPT/mock/finetuning datasets, the tokenizer and the sequence-packing specs
(Megatron Bridge)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from longspan.core.model_parallel_config import RUNTIME_FIELD

@dataclass
class DataloaderConfig:
    """How samples are loaded."""

    dataloader_type: Optional[Literal["single", "cyclic", "external"]] = None
    """'single' reads the data once in order (Megatron's pretraining sampler), 'cyclic' reshuffles each epoch,
    'external' uses the iterators the caller gives; None means 'single'."""

    num_workers: int = 8
    """DataLoader worker processes (0 loads in the training process)."""

    data_sharding: bool = True
    """With the cyclic sampler: each data-parallel rank reads its own shard of the data."""

    pin_memory: bool = True
    """Pin host memory for faster host-to-accelerator copies (no effect without an accelerator)."""

    persistent_workers: bool = False
    """Keep DataLoader workers alive between epochs."""


@dataclass(kw_only=True)
class GPTDatasetConfig(DataloaderConfig):
    """GPT pretraining data: Megatron Core's GPTDatasetConfig fields plus DataloaderConfig and ``data_path``."""

    random_seed: int
    """Seed of the shuffles that order documents and samples."""

    sequence_length: int
    """Tokens per sample (must equal model.seq_length)."""

    seq_length: Optional[int] = None
    """Current Megatron Bridge's name for sequence_length: when set, it is the sequence length (validate()
    copies it to sequence_length)."""

    blend: Optional[list[Any]] = None
    """[paths, weights or null]: dataset prefixes blended for all splits (Megatron Core's blend)."""

    blend_per_split: Optional[list[Any]] = None
    """One blend per split (train, valid, test), each [paths, weights or null] or null."""

    split: Optional[str] = None
    """Split of one blend into train/valid/test, e.g. '969,30,1' (normalized weights)."""

    num_dataset_builder_threads: int = 1
    """Threads that build the per-dataset indices."""

    path_to_cache: Optional[str] = None
    """Directory for the cached sample indices; None caches beside the data."""

    mmap_bin_files: bool = True
    """Memory-map the .bin files (False reads them with file I/O)."""

    mock: bool = False
    """Use Megatron's synthetic mock data instead of files."""

    tokenizer: Optional[Any] = field(default=None, metadata=RUNTIME_FIELD)
    """The tokenizer object, set at start-up from the tokenizer config (never written to YAML)."""

    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples each blended component builds, so rounding never runs short."""

    reset_position_ids: Optional[bool] = None
    """Restart position ids after each end-of-document token; None is resolved to False by validate()."""

    reset_attention_mask: Optional[bool] = None
    """Block attention across end-of-document tokens; None is resolved to False by validate()."""

    eod_mask_loss: Optional[bool] = None
    """Exclude end-of-document positions from the loss; None is resolved to False by validate()."""

    create_attention_mask: bool = True
    """Put an explicit attention mask in each sample (True = masked, Megatron's convention)."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the last partial validation sample instead of padding it."""

    add_extra_token_to_sequence: bool = True
    """Read sequence_length + 1 tokens per sample so labels are the inputs shifted by one."""

    object_storage_cache_path: Optional[str] = None
    """Local cache for datasets read from object storage."""

    data_path: Optional[str] = None
    """CLI form of a blend: 'PREFIX', 'W1 P1 W2 P2 ...', or 'builtin:NAME' for a corpus that ships with longspan.
    Converted to ``blend`` by the data builder; None (and no blend) means mock data."""

    def __post_init__(self) -> None:
        """Nothing: checks run in ``ConfigContainer.validate()`` (lazy validation)."""


@dataclass(kw_only=True)
class MockGPTDatasetConfig(GPTDatasetConfig):
    """GPT dataset config that always uses Megatron's synthetic mock data (no blend, no files)."""

    blend: None = None
    """Always None: mock data has no files."""

    blend_per_split: None = None
    """Always None: mock data has no files."""

    mock: bool = True
    """Always True."""


@dataclass(kw_only=True)
class T5MaskedWordPieceDatasetConfig(GPTDatasetConfig):
    """T5 span-corruption data on ``.bin``/``.idx`` files (megatron-core's T5MaskedWordPieceDatasetConfig fields,
    with Megatron-LM's pretrain_t5 values as defaults); built by ``longspan.data.t5_dataset``. ``sequence_length``
    is the encoder length. The GPT-only switches (reset_position_ids, reset_attention_mask, eod_mask_loss,
    add_extra_token_to_sequence) do not apply and are rejected when set."""

    sequence_length_decoder: int = 128
    """Decoder length: the decoder input (bos, sentinels, masked tokens) is padded to it."""

    masking_probability: float = 0.15
    """Fraction of the tokens (of the target length) to mask, in spans."""

    short_sequence_probability: float = 0.1
    """Probability that a sample's target length is drawn shorter than sequence_length - 2."""

    masking_max_ngram: int = 10
    """Longest span to mask, in words."""

    masking_do_full_word: bool = True
    """Mask whole words (a WordPiece '##' piece joins the word before it)."""

    masking_do_permutation: bool = False
    """Also shuffle the tokens of some unmasked n-grams (1/n sizes, up to the masking budget) among themselves in
    the encoder input (megatron-core's BERT-style permutation); needs masking_use_geometric_distribution=False."""

    masking_use_longer_ngrams: bool = False
    """Favour longer n-grams (reverse the 1/n distribution); ignored with the geometric distribution."""

    masking_use_geometric_distribution: bool = True
    """Draw span lengths from a geometric distribution (p=0.2, SpanBERT) instead of 1/n."""


@dataclass
class FinetuningDatasetConfig(DataloaderConfig):
    """Supervised finetuning data: JSONL files under dataset_root (longspan.data.sft, Megatron Bridge's GPT SFT data)."""

    dataset_root: Optional[str] = None
    """Directory with training.jsonl, validation.jsonl and optionally test.jsonl; records are prompt/completion
    ({"input", "output"}) or chat ({"messages": [{"role", "content"}, ...]}). Line indexes (and packs) are cached here."""

    seq_length: Optional[int] = None
    """Maximum tokens per sample (longer records are truncated); None means model.seq_length."""

    seed: int = 1234
    """Seed of the training sample order (each epoch a fresh permutation) and of the packing tie-breaks."""

    memmap_workers: int = 1
    """Threads that scan a JSONL file when its line index is built (once; the index is cached beside it)."""

    max_train_samples: Optional[int] = None
    """Length of the training split in samples (epochs over the records); None means train_iters x
    global_batch_size. Fewer than the run needs is an error."""

    packed_sequence_specs: Optional[dict[str, Any]] = None
    """Sequence packing: a mapping of (or a longspan.training.config.PackedSequenceSpecs with) Megatron Bridge's
    PackedSequenceSpecs fields (packed_sequence_size, packed_train_data_path, packed_val_data_path,
    packed_metadata_path, pad_cu_seqlens, pad_seq_to_mult, ...); None or a size <= 0: off."""

    dataset_kwargs: Optional[dict[str, Any]] = None
    """Formatting options (Bridge's GPT SFT dataset arguments): prompt_template, label_key, truncation_field,
    truncation_method, add_bos, add_eos, answer_only_loss, pad_to_max_length, pad_seq_length_to_mult, chat,
    messages_key, and for chat records loss_mode ('assistant' | 'last_turn' | 'full', Bridge's
    ChatSFTPreprocessingConfig.loss_mode) and train_on_think (False: <think> spans out of the loss). Unknown keys
    are rejected."""

    do_validation: bool = True
    """Build the validation split from validation.jsonl (which must then exist)."""

    do_test: bool = True
    """Build the test split from test.jsonl when the file exists."""


@dataclass(kw_only=True)
class TokenizerConfig:
    """Which tokenizer to build (Megatron Bridge / Megatron-LM field names)."""

    tokenizer_type: Optional[str] = None
    """'HuggingFaceTokenizer', 'SentencePieceTokenizer', 'GPT2BPETokenizer', 'NullTokenizer', 'ByteTokenizer', ..."""

    tokenizer_model: Optional[str] = None
    """Tokenizer model: a HF directory or tokenizer.json, a SentencePiece .model file, a TikToken vocabulary
    (.json), or 'builtin:NAME'."""

    vocab_size: Optional[int] = None
    """Vocabulary size (NullTokenizer; TikTokenizer's whole vocabulary, None: 131072)."""

    vocab_file: Optional[str] = None
    """Vocabulary file (GPT2BPETokenizer's vocab.json, BERT's vocab.txt)."""

    merge_file: Optional[str] = None
    """BPE merges file (GPT2BPETokenizer)."""

    vocab_extra_ids: int = 0
    """Extra sentinel tokens to add (T5)."""

    special_tokens: Optional[list[str]] = None
    """Additional special tokens (as Hugging Face's additional_special_tokens): one already in the vocabulary
    keeps its id, the others get new ids after it; each one in the text becomes its single id."""

    tiktoken_pattern: Optional[str] = None
    """TikTokenizer's pre-tokenization regex: 'v1' or 'v2' (megatron-core's patterns); required for it."""

    tiktoken_num_special_tokens: int = 1000
    """TikTokenizer: ids reserved for special tokens before the BPE vocabulary (fillers <SPECIAL_i> pad the list)."""

    tiktoken_special_tokens: Optional[list[str]] = None
    """TikTokenizer's special tokens, ids 0.. in order; must include <unk> <s> </s> <mask> <pad> <cls> <sep>
    (None: exactly those)."""

    tokenizer_prompt_format: Optional[str] = None
    """Prompt format for chat/SFT data."""

    image_tag_type: Optional[str] = None
    """Image tag for multimodal tokenizers."""

    hf_tokenizer_kwargs: Optional[dict[str, Any]] = None
    """Extra keyword arguments for ``AutoTokenizer.from_pretrained``."""

    chat_template: Optional[str] = None
    """Chat template (Jinja) for chat SFT records; None uses the tokenizer's own (tokenizer_config.json)."""

    metadata_path: Optional[Union[str, dict[str, Any]]] = None
    """megatron-core tokenizer metadata (a JSON file or a mapping): its library ('huggingface', 'sentencepiece',
    'tiktoken', 'null', 'byte-level') gives tokenizer_type and its chat_template the chat template, where those
    are null."""

    make_vocab_size_divisible_by: int = 1
    """A model.vocab_size left null is the tokenizer's vocabulary rounded up to a multiple of this (1: exactly
    the tokenizer's); model.make_vocab_size_divisible_by pads the embedding table further."""


@dataclass
class PackedSequenceSpecs:
    """Megatron Bridge's ``PackedSequenceSpecs`` (``dataset.packed_sequence_specs``, a mapping in YAML)."""

    packed_sequence_size: int = -1
    """Tokens per pack; a positive value turns packing on (it must equal model.seq_length)."""

    max_single_sequence_length: Optional[int] = None
    """Documents are truncated to this many tokens before packing; None means dataset.seq_length."""

    tokenizer_model_name: Optional[str] = None
    """Name of the tokenizer, used in the default packed file paths (packed/{name}/...)."""

    num_tokenizer_workers: int = -1
    """Worker processes for tokenizing while packing; only -1 (tokenize in this process) is supported."""

    packed_train_data_path: Optional[str] = None
    """Packed training file (.npy); built there when missing. None: cached under dataset_root/packed/."""

    packed_val_data_path: Optional[str] = None
    """Packed validation file (.npy); built there when missing. None: cached under dataset_root/packed/."""

    packed_metadata_path: Optional[str] = None
    """Also write the packing metadata here (a JSON list: training, then validation, as Bridge does)."""

    pad_cu_seqlens: bool = False
    """Pad the batch's ``cu_seqlens`` to a fixed length (max documents per pack + 1) for static shapes."""

    pad_seq_to_mult: Optional[int] = 1
    """Pad each document inside its pack to a multiple of this many tokens (padding carries no loss)."""
