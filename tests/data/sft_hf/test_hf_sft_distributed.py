"""Two ranks build the same direct HF SFT datasets (rank 0 fills the datasets cache first), and a bad file
stops every rank with rank 0's line instead of leaving the others waiting."""

from __future__ import annotations

import pytest

from tests.data.sft_hf.conftest import SEQ, as_sharegpt, conversations, write_json_array, write_jsonl
from tests.parallel.harness import WorkerError


def _build_case(path: str, tokenizer_dir: str, cache: str) -> list:
    import os

    os.environ["LONGSPAN_CACHE"] = cache
    from tests.parallel.harness import init_gloo

    from longspan.config.schema.data_hf import DirectHFSFTDatasetConfig, HFDatasetSourceConfig
    from longspan.core.errors import DataError
    from longspan.data.sft.hf_dataset import build_direct_hf_sft_datasets
    from longspan.data.tokenizers import HuggingFaceTokenizer

    init_gloo(timeout_s=60)
    d = DirectHFSFTDatasetConfig(seq_length=SEQ, source=HFDatasetSourceConfig(path_or_dataset=path), num_workers=0)
    try:
        train = build_direct_hf_sft_datasets(d, HuggingFaceTokenizer(tokenizer_dir), (20, 0, 0), SEQ)[0]
    except DataError as exc:
        return ["DataError", str(exc)]
    return [train[i]["tokens"].tolist() for i in range(20)]


def test_two_ranks_build_the_same_samples_and_share_errors(tmp_path, hf_sft_tokenizer_dir, pool2):
    good = write_json_array(str(tmp_path / "chat.json"), [as_sharegpt(c) for c in conversations(10)])
    a, b = pool2.run(_build_case, good, hf_sft_tokenizer_dir, str(tmp_path / "cache"), timeout=120)
    assert a == b and len(a) == 20
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), [{"messages": [{"role": "user", "content": "hi"}]}])
    try:
        results = pool2.run(_build_case, bad, hf_sft_tokenizer_dir, str(tmp_path / "cache"), timeout=120)
    except WorkerError as exc:  # pragma: no cover - a hang or crash is the failure this test guards against
        pytest.fail(f"a rank failed instead of reporting the data error: {exc}")
    assert results[0] == results[1] == ["DataError", f"{bad} row 0: the conversation has no assistant turn, so "
                                                     "nothing would be trained on (schema_adapter 'messages')"]
