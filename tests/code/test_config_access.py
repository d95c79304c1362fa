"""Config is read by attribute: a renamed field must fail loudly, not fall back to a default.

``getattr(config_like, "field", default)`` hides a renamed or misspelt field behind its default. The few that stay
(objects that really vary: user-supplied callables, third-party configs, providers of other model kinds) carry a
``# getattr: <reason>`` comment on the call's line, and there are at most ``BUDGET`` of them.
"""

from __future__ import annotations

import ast
import re

from tests.code.import_graph import ROOT, longspan_modules

BUDGET = 40
# The first argument reads like a config object: a config/provider/section variable or an attribute of one.
CONFIG_LIKE = re.compile(r"(cfg|config|provider|conf|spec|args)\b|(cfg|config|provider)\.", re.IGNORECASE)


def config_getattrs(source: str) -> list[tuple[int, str]]:
    """(line, call text) of every three-argument ``getattr`` with a literal name on a config-like object."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            first = ast.get_source_segment(source, node.args[0]) or ""
            if CONFIG_LIKE.search(first):
                found.append((node.lineno, ast.get_source_segment(source, node) or ""))
    return found


def _all() -> list[tuple[str, int, str, bool]]:
    out = []
    for _, path in longspan_modules().items():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for line, text in config_getattrs(source):
            span = range(line - 1, line - 1 + text.count("\n") + 1)
            reasoned = any("# getattr:" in lines[i] for i in span)
            out.append((str(path.relative_to(ROOT.parent)), line, text.splitlines()[0], reasoned))
    return out


def test_the_counter_sees_a_config_getattr() -> None:
    source = 'x = getattr(cfg.model, "hidden_size", 4)\ny = getattr(module, "weight", None)\n'
    assert [line for line, _ in config_getattrs(source)] == [1]


def test_config_getattrs_with_defaults_stay_within_budget() -> None:
    found = _all()
    listing = "\n".join(f"{path}:{line}: {text}" for path, line, text, _ in found)
    assert len(found) <= BUDGET, f"{len(found)} getattr-with-default reads of config (budget {BUDGET}):\n{listing}"


def test_every_remaining_config_getattr_says_why() -> None:
    unreasoned = [f"{path}:{line}: {text}" for path, line, text, reasoned in _all() if not reasoned]
    assert not unreasoned, ("config read with getattr and a default, without a '# getattr: <reason>' comment "
                            "(read the field, or say why it may be absent):\n" + "\n".join(unreasoned))
