"""A run whose YAML names Megatron Bridge's DirectHFSFTDatasetConfig trains on ShareGPT JSON and Alpaca JSONL
blended, through the real trainer (the data path finetune() uses): the loss falls, the loss-token counts differ
between batches (uneven masks) and validation runs on its own source."""

from __future__ import annotations

import yaml

from tests.data.sft.conftest import make_hf_tokenizer_dir
from tests.data.sft_hf.conftest import as_alpaca, as_sharegpt, conversations, single_turn, write_json_array, write_jsonl
from tests.training.pretrain_helpers import read_metrics, small_config

ITERS = 8


def test_yaml_run_with_direct_hf_sft_data_trains(tmp_path):
    from longspan.training.config import ConfigContainer
    from longspan.training.pretrain import pretrain
    from longspan.training.step.forward_step import forward_step

    tok = make_hf_tokenizer_dir(str(tmp_path / "tok"))
    convs = conversations(60, seed=11)
    sharegpt = write_json_array(str(tmp_path / "data" / "chat.json"), [as_sharegpt(c) for c in convs[:40]])
    alpaca = write_jsonl(str(tmp_path / "data" / "alpaca.jsonl"), [as_alpaca(c) for c in single_turn(convs)])
    valid = write_jsonl(str(tmp_path / "data" / "valid.jsonl"), [{"messages": c} for c in convs[40:]])
    cfg = small_config(tmp_path, "hf_sft", train_iters=ITERS, eval_interval=ITERS, eval_iters=1)
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = tok
    cfg.tokenizer.vocab_size = None
    data = cfg.to_dict()
    data["dataset"] = yaml.safe_load(f"""
_target_: megatron.bridge.data.builders.direct_hf_sft.DirectHFSFTDatasetConfig
seq_length: 64
source:
  - _target_: megatron.bridge.data.sources.hf.HFDatasetSourceConfig
    path_or_dataset: {sharegpt}
  - _target_: megatron.bridge.data.sources.hf.HFDatasetSourceConfig
    path_or_dataset: {alpaca}
source_weights: [0.5, 0.5]
validation_source:
  _target_: megatron.bridge.data.sources.hf.HFDatasetSourceConfig
  path_or_dataset: {valid}
do_test: false
num_workers: 0
pad_to_multiple_of: 16
""")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    run = ConfigContainer.from_yaml(str(path))
    pretrain(run, forward_step)
    records = read_metrics(run)
    losses = [r["losses"]["lm loss"] for r in records]
    assert len(losses) == ITERS and losses[-1] < losses[0]
    assert len({r["loss_tokens"] for r in records}) > 1  # uneven masks
    import json
    from pathlib import Path

    lines = (Path(run.logger.tensorboard_dir) / "metrics.jsonl").read_text().splitlines()
    validation = [json.loads(x) for x in lines if '"validation"' in x]
    assert validation and validation[-1]["losses"]["lm loss"] > 0
