"""Bad input through the CLI: one line on stderr, exit code 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from longspan.cli import main

BAD_FILES = {
    "bad_yaml.yaml": "train: [1, 2\n",
    "python_tag.yaml": "train: !!python/object/apply:os.system ['true']\n",
    "os_target.yaml": "_target_: os.system\n",
    "section_scalar.yaml": "train: 5\n",
    "top_list.yaml": "- 1\n- 2\n",
    "unknown_section.yaml": "trainer:\n  max_steps: 3\n",
    "bad_activation.yaml": "model:\n  activation_func:\n    _target_: builtins.eval\n    _call_: false\n",
}

# (argv tail, a fragment the one-line message must contain)
CASES = [
    (["show", "--recipe", "tinyy"], "unknown recipe 'tinyy': did you mean tiny?"),
    (["show"], "no configuration given"),
    (["show", "--recipe", "tiny", "train.train_iter=3"], "did you mean train_iters"),
    (["show", "--recipe", "tiny", "train.train_iters=abc"], "train.train_iters='abc' has the wrong type: expected int"),
    (["show", "--recipe", "tiny", "scheduler.lr_decay_style=cosin"], "choose one of 'constant'"),
    (["show", "--recipe", "tiny", "model.params_dtype=int8"], "model.params_dtype='int8' is not a dtype"),
    (["show", "--recipe", "tiny", "model.activation_func=os.system"], "not an allowed function"),
    (["show", "--recipe", "tiny", "train.train_iters"], "is not of the form section.field=value"),
    (["show", "--recipe", "tiny", "train.train_iters.x=1"], "is a field, not a section"),
    (["show", "--recipe", "tiny", "mixed_precision=[1, 2"], "is not valid YAML"),
    (["show", "--recipe", "tiny", "--config", "missing.yaml"], "does not exist"),
    (["show", "--recipe", "tiny", "--config", "bad_yaml.yaml"], "not valid YAML"),
    (["show", "--recipe", "tiny", "--config", "python_tag.yaml"], "not valid YAML"),
    (["show", "--recipe", "tiny", "--config", "os_target.yaml"], "_target_ 'os.system' is not allowed"),
    (["show", "--recipe", "tiny", "--config", "section_scalar.yaml"], "train=5 has the wrong type: expected a mapping"),
    (["show", "--recipe", "tiny", "--config", "top_list.yaml"], "top level must be a mapping"),
    (["show", "--recipe", "tiny", "--config", "unknown_section.yaml"], "unknown key 'trainer'"),
    (["show", "--recipe", "tiny", "--config", "bad_activation.yaml"], "_target_ 'builtins.eval' is not allowed"),
    (["validate", "--recipe", "tiny", "--world-size", "3"], "global_batch_size=16 is not divisible"),
    (["validate", "--recipe", "tiny", "--world-size", "2", "model.tensor_model_parallel_size=4"], "world size 2 is not divisible"),
    (["validate", "--recipe", "tiny", "mixed_precision=bf17"], "mixed_precision='bf17' is not a known recipe"),
    (["validate", "--recipe", "tiny", "model.seq_length=128"], "differs from model.seq_length=128"),
    (["validate", "--recipe", "tiny", "--world-size", "4", "model.context_parallel_size=2",
      "model.hierarchical_context_parallel_sizes=[2, 1]"],
     "model.hierarchical_context_parallel_sizes=[2, 1] is read only by cp_comm_type='a2a+p2p' (model.cp_comm_type=None)"),
    (["validate", "--recipe", "tiny", "checkpoint.async_save=true", "checkpoint.ckpt_format=zarr"],
     "checkpoint.ckpt_format='zarr' is not supported yet by longspan (supported: 'torch_dist'"),
    (["validate", "--recipe", "tiny", "model.sequence_parallel=true"], "needs model.tensor_model_parallel_size > 1"),
    (["validate", "--recipe", "tiny", "--world-size", "0"], "world size=0 is not valid"),
    (["validate", "--recipe", "tiny", "train.rampup_batch_size=[4, 4]", "train.train_iters=null",
      "train.train_samples=1000"], "must be three positive integers"),
]


@pytest.mark.parametrize("argv,fragment", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture, argv: list[str], fragment: str) -> None:
    for name, text in BAD_FILES.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    code = main(["config", *argv])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("longspan: error: ")
    assert fragment in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_bad_argument_is_argparse_exit_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["config", "validate", "--recipe", "tiny", "--world-size", "two"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_validate_prints_derived_values(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "validate", "--recipe", "tiny", "--world-size", "4", "model.tensor_model_parallel_size=2"]) == 0
    out = capsys.readouterr().out
    assert "data_parallel_size: 2" in out and "num_microbatches: 4" in out
    assert f"lr_decay_steps: {200 * 16}" in out


def test_overrides_may_come_before_and_after_options(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "show", "train.train_iters=5", "--recipe", "tiny", "train.eval_iters=3"]) == 0
    out = capsys.readouterr().out
    assert "  train_iters: 5\n" in out and "  eval_iters: 3\n" in out
