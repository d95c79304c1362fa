"""The package layering of longspan/, and why each function-level import is one.

Layers, lowest first; a module may import its own layer and the layers below it, never one above:

    core → config → models, data → parallel, peft, conversion → inference, planner → training → recipes
    → families → cli → longspan (the package's ``__init__`` and ``__main__``)

A family package (``longspan/families/<name>/``) spans layers: each of its modules has the layer of its role,
read from the file name (``FAMILY_ROLES``: ``hf.py`` is conversion, ``parallel.py`` parallel, ``recipes.py``
recipes, anything else models), and its ``__init__`` (which registers the pieces) is the families layer.

inference (text generation over the models' KV cache) and planner (memory/time estimates of a layout) use models
and the parallel plans' arithmetic, and nothing below training uses them, so they sit just above
parallel/peft/conversion. Every import counts: function-level ones, ``if TYPE_CHECKING:`` ones (they never run,
but the module still leans on that layer) and imports by name (``importlib.import_module("longspan.x")``,
``__import__``, and string constants that are dotted paths into longspan modules, resolved later:
``tests.code.import_graph.string_imports``).

A function-level import is allowed only with a comment saying why (an optional dependency, start-up time, an
import that must wait for something): on the import's own line(s) or on the line right above it, where a comment
above a run of consecutive imports covers the run.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import Counter
from pathlib import Path

import pytest

from tests.code.import_graph import (
    ROOT,
    ImportStatement,
    import_statements,
    longspan_modules,
    parse,
    string_imports,
)

LAYERS: list[tuple[str, ...]] = [
    ("core",),
    ("config",),
    ("models", "data"),
    ("parallel", "peft", "conversion"),
    ("inference", "planner"),
    ("training",),
    ("recipes",),
    ("families",),
    ("cli",),
    ("longspan",),
]
LAYER_OF: dict[str, int] = {package: i for i, packages in enumerate(LAYERS) for package in packages}
ORDER = " → ".join(", ".join(packages) for packages in LAYERS)


# Upward edges by name that are known not to be imports: (module, named module), each with its reason. A new
# entry needs one; a stale entry fails its own test.
KNOWN_STRING_EDGES: set[tuple[str, str]] = {
    # the module name longspan writes in YAML `_target_`s of its config classes (Bridge's module path); a name in
    # a file, resolved through the config catalog, never imported
    ("longspan.config.targets", "longspan.training.config"),
}


# A family module's layer by its file name; other names are model code (providers, layers).
FAMILY_ROLES = {"hf": "conversion", "parallel": "parallel", "recipes": "recipes"}


def package_of(module: str) -> str:
    """'longspan.config.rules.layout' -> 'config'; the package root and ``__main__`` -> 'longspan'; a family
    module -> the layer of its role ('longspan.families.qwen.hf' -> 'conversion')."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "longspan"
    if parts[1] == "families" and len(parts) >= 4:
        return FAMILY_ROLES.get(parts[3], "models")
    return parts[1]


def upward_imports(graph: dict[str, list[tuple[int, str]]], paths: dict[str, Path]) -> list[str]:
    """One line per import of a higher layer: where, which modules, which layers."""
    out = []
    for module, edges in sorted(graph.items()):
        src = package_of(module)
        for line, target in sorted(edges):
            dst = package_of(target)
            if LAYER_OF[dst] > LAYER_OF[src]:
                where = f"{paths[module].relative_to(ROOT.parent)}:{line}" if module in paths else module
                out.append(
                    f"{where}: {module} (layer {LAYER_OF[src]}: {src}) imports {target} "
                    f"(layer {LAYER_OF[dst]}: {dst})"
                )
    return out


def module_edges(name: str, tree: ast.AST, is_package: bool, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, longspan module) of every import of module ``name`` the layering counts: statements (function-level
    and TYPE_CHECKING ones included) and imports by name."""
    edges = set()
    for stmt in import_statements(tree, name, is_package, type_checking=True):
        edges.update((stmt.line, t) for t in stmt.targets if t in modules and t != name)
    edges.update((line, t) for line, t in string_imports(tree, modules) if t != name)
    return sorted(edges)


def _edges() -> tuple[dict[str, list[tuple[int, str]]], dict[str, Path]]:
    modules = longspan_modules()
    graph = {name: module_edges(name, parse(path), path.name == "__init__.py", modules)
             for name, path in modules.items()}
    return graph, modules


def _unknown(graph: dict[str, list[tuple[int, str]]]) -> dict[str, list[tuple[int, str]]]:
    """``graph`` without the known edges (``KNOWN_STRING_EDGES``)."""
    return {m: [(line, t) for line, t in edges if (m, t) not in KNOWN_STRING_EDGES] for m, edges in graph.items()}


def _comment_lines(source: str) -> set[int]:
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            lines.add(tok.start[0])
    return lines


def uncommented_function_imports(source: str, statements: list[ImportStatement]) -> list[int]:
    """Lines of function-level imports with no comment on their lines nor above them (or above their run)."""
    comments = _comment_lines(source)
    import_lines = {line for stmt in statements for line in range(stmt.line, stmt.end_line + 1)}
    out = []
    for stmt in statements:
        if not stmt.function_level:
            continue
        if comments & set(range(stmt.line, stmt.end_line + 1)):
            continue
        above = stmt.line - 1
        while above in import_lines and above not in comments:
            above -= 1  # a run of consecutive imports shares the comment above it
        if above not in comments:
            out.append(stmt.line)
    return out


def function_import_offenders() -> list[str]:
    out = []
    for name, path in longspan_modules().items():
        source = path.read_text(encoding="utf-8")
        statements = import_statements(ast.parse(source), name, path.name == "__init__.py")
        where = path.relative_to(ROOT.parent)
        out.extend(f"{where}:{line}" for line in uncommented_function_imports(source, statements))
    return out


def _package_of_path(path: str) -> str:
    """'longspan/cli/x.py' -> 'cli'; files at the package root -> 'longspan'."""
    parts = Path(path).parts
    return parts[1] if len(parts) > 2 else "longspan"


# ---------------------------------------------------------------------------------------------------------------
def test_every_package_has_a_layer() -> None:
    packages = {package_of(name) for name in longspan_modules()}
    assert packages <= set(LAYER_OF), f"packages without a layer: {sorted(packages - set(LAYER_OF))}"


def test_the_layering_check_names_both_modules_and_layers() -> None:
    paths = {"longspan.config.rules.layout": ROOT / "config" / "rules" / "layout.py"}
    found = upward_imports({"longspan.config.rules.layout": [(3, "longspan.training.state"), (4, "longspan.core")]},
                           paths)
    assert found == [
        "longspan/config/rules/layout.py:3: longspan.config.rules.layout (layer 1: config) imports "
        "longspan.training.state (layer 5: training)"
    ]


def test_no_package_imports_a_higher_layer() -> None:
    graph, paths = _edges()
    found = upward_imports(_unknown(graph), paths)
    assert not found, f"{len(found)} upward imports (the order is {ORDER}):\n" + "\n".join(found)


def test_the_known_upward_edges_still_exist() -> None:
    graph, _ = _edges()
    present = {(m, t) for m, edges in graph.items() for _, t in edges}
    gone = sorted(KNOWN_STRING_EDGES - present)
    assert not gone, "KNOWN_STRING_EDGES lists edges that are gone (remove them):\n" + "\n".join(map(str, gone))


PLANTED = '''import importlib
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from longspan.inference.text_generation import generate
PROVIDER = "longspan.models.gpt_provider.GPTModelProvider"
def run():
    """Starts longspan.training.state, by name (a docstring: not an import)."""
    return importlib.import_module("longspan.training.pretrain")
def loop():
    return __import__("longspan.training.train")
'''


def test_the_layering_check_reads_imports_by_name_and_type_checking_imports() -> None:
    name = "longspan.config.planted"
    edges = module_edges(name, ast.parse(PLANTED), False, longspan_modules())
    found = upward_imports({name: edges}, {name: ROOT / "config" / "planted.py"})
    assert found == [
        f"longspan/config/planted.py:{line}: {name} (layer 1: config) imports {target} (layer {layer})"
        for line, target, layer in ((4, "longspan.inference.text_generation", "4: inference"),
                                    (5, "longspan.models.gpt_provider", "2: models"),
                                    (8, "longspan.training.pretrain", "5: training"),
                                    (10, "longspan.training.train", "5: training"))
    ]


def test_the_comment_check_sees_function_level_imports() -> None:
    source = (
        "import os\n"
        "def f():\n"
        "    import torch\n"
        "def g():\n"
        "    # optional dependency\n"
        "    import yaml\n"
        "    import json\n"
        "    import sys  # start-up time\n"
        "if TYPE_CHECKING:\n"
        "    import torch\n"
    )
    statements = import_statements(ast.parse(source), "longspan.x", False)
    assert uncommented_function_imports(source, statements) == [3]


def test_every_function_level_import_says_why() -> None:
    found = function_import_offenders()
    per_package = Counter(_package_of_path(offender.split(":")[0]) for offender in found)
    summary = ", ".join(f"{p}: {n}" for p, n in per_package.most_common())
    assert not found, (
        f"{len(found)} function-level imports without a comment saying why ({summary}):\n" + "\n".join(found)
    )


@pytest.mark.parametrize("package", ["core", "config"])
def test_function_level_imports_say_why_in_cleaned_packages(package: str) -> None:
    found = [o for o in function_import_offenders() if _package_of_path(o.split(":")[0]) == package]
    assert not found, "function-level imports without a comment saying why:\n" + "\n".join(found)
