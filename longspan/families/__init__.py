"""The model families: one package per family, everything specific to it in one place.

A family package holds, each in the module of its layer (``tests/code/test_layering.py`` reads the role from
the file name): ``hf.py`` (conversion: the two-way config.json field table, the weight table, the
``conversion.families.Family`` entries), ``provider.py`` / ``model.py`` (models: a provider or layers beyond the
shared blocks, where the family has them), a ``parallel`` module (plan pieces, where the family needs its
own), ``recipes.py`` (recipes), and its
``__init__.py``, which registers them all. Shared blocks (attention, MLP, MoE, norms, rotary, MLA, the GPT, T5
and Mamba stacks) stay in ``longspan.models`` and are chosen by provider fields, never by family name.

The list below is the registry: adding a family is its package and one name here. ``longspan/__init__.py``
imports this package on the first registry lookup (``longspan.core.plugins``).
"""

from __future__ import annotations

# The registry: one name per family package, imported in this order (each registers itself).
from longspan.families import (  # noqa: F401
    llama,
    mistral,
    mixtral,
    qwen,
    phi,
    gemma,
    olmo,
    gpt2,
    gpt_oss,
    glm,
    deepseek,
    qwen_vl,
    qwen3_vl,
    gemma_vl,
    t5,
    mamba,
    nemotron,
    olmoe,
    qwen3_next,
    qwen35,
    minimax,
    gemma4,
    mimo,
)

# The export's guess for checkpoints that do not record their family; it names the families, so it sits here.
from longspan.families import fallback  # noqa: F401,E402
