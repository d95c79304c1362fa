"""Megatron's compute-scheduling / memory-layout switches accepted as performance hints keep megatron-core's
consistency rules (longspan.config.rules.scheduling_hints), and are listed at start-up as having no effect."""

from __future__ import annotations

import pytest

from longspan.config import inapplicable_fields
from longspan.config.support import HINT, field_status
from longspan.core.errors import ConfigError
from longspan.recipes.loading import load_config

FIELDS = ("distribute_saved_activations", "delay_wgrad_compute", "defer_embedding_wgrad_compute",
          "wgrad_deferral_limit")


@pytest.mark.parametrize("overrides, needle", [
    (["model.distribute_saved_activations=true", "model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
     "must be False with model.sequence_parallel=True"),
    (["model.defer_embedding_wgrad_compute=true", "model.gradient_accumulation_fusion=true"],
     "needs model.pipeline_model_parallel_size > 1"),
    (["model.defer_embedding_wgrad_compute=true", "model.pipeline_model_parallel_size=2"],
     "needs model.gradient_accumulation_fusion=True"),
    (["model.wgrad_deferral_limit=2"], "read only with model.defer_embedding_wgrad_compute=True"),
    (["model.delay_wgrad_compute=true"], "needs model.overlap_moe_expert_parallel_comm=True"),
])
def test_megatron_rules_hold(overrides, needle):
    cfg = load_config("tiny", [], overrides)
    with pytest.raises(ConfigError, match=needle) as err:
        cfg.validate(world_size=2)
    assert "\n" not in str(err.value)


def test_valid_settings_are_accepted_and_listed_as_hints():
    assert all(field_status("model", name) == HINT for name in FIELDS)
    cfg = load_config("tiny", [], [
        "model.pipeline_model_parallel_size=2", "model.defer_embedding_wgrad_compute=true",
        "model.gradient_accumulation_fusion=true", "model.wgrad_deferral_limit=2",
        "model.distribute_saved_activations=true", "model.recompute_granularity=full",
        "model.recompute_method=uniform", "model.recompute_num_layers=1"])
    cfg.validate(world_size=2)
    listed = inapplicable_fields(cfg)
    assert {"model.defer_embedding_wgrad_compute=True", "model.wgrad_deferral_limit=2",
            "model.distribute_saved_activations=True"} <= set(listed)
