"""load_model_from_checkpoint(parallel=...) builds the model for a layout and loads the same weights."""

from __future__ import annotations

import pytest
import torch

from longspan.training.checkpointing.model_loading import load_model_from_checkpoint
from tests.inference.helpers import train_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root, _, _ = train_tiny_checkpoint(tmp_path_factory.mktemp("layouts"), iters=2)
    return root


def _load_on_rank(root: str, overrides: list[str], tokens: torch.Tensor) -> dict:
    from torch.distributed.tensor import DTensor

    from longspan.models.init import canonical_parameter_name
    from longspan.parallel import initialize_distributed
    from longspan.training.checkpointing.model_loading import load_checkpoint_config, load_model_from_checkpoint

    cfg = load_checkpoint_config(root, overrides).cfg
    parallel = initialize_distributed(cfg.dist, cfg.model, device="cpu")
    loaded = load_model_from_checkpoint(root, overrides, parallel=parallel)
    params = {}
    for chunk in loaded.model:
        assert not chunk.training
        for name, p in chunk.named_parameters():
            params[canonical_parameter_name(name)] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    logits = None
    if parallel.pp_size == 1:
        with torch.no_grad():
            out = loaded.model[0](tokens)
        logits = out.full_tensor() if isinstance(out, DTensor) else out
    return {"params": params, "logits": logits, "iteration": loaded.iteration}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["model.tensor_model_parallel_size=2"], ["model.pipeline_model_parallel_size=2"]])
def test_layout_load_equals_one_process(checkpoint, pool2, layout):
    reference = load_model_from_checkpoint(checkpoint)
    model = reference.model[0]
    tokens = torch.randint(0, reference.cfg.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected_logits = model(tokens)
    expected = dict(model.named_parameters())
    results = pool2.run(_load_on_rank, str(checkpoint), layout, tokens)
    for rank, result in enumerate(results):
        assert result["iteration"] == 2
        if result["logits"] is not None:  # tensor parallel: every rank holds the whole output
            torch.testing.assert_close(result["logits"], expected_logits, atol=1e-5, rtol=1e-5)
        for name, tensor in result["params"].items():
            assert torch.equal(tensor, expected[name].detach()), (rank, name)
    # Together the ranks hold every parameter (pipeline stages split them).
    assert set().union(*(r["params"] for r in results)) == set(expected)
