"""Every import statement of longspan/, read with ``ast`` (nothing is imported): the shared reader of the
import-cycle and layering tests.

An import names the longspan modules it points at: ``import a.b`` points at ``a.b``; ``from pkg import name``
points at ``pkg`` and at ``pkg.name`` (kept only when that is a module). Imports under ``if TYPE_CHECKING:`` are
left out unless asked for (they never run, so they cannot make a cycle, but they still say which layer a module
leans on); imports inside functions are kept and marked ``function_level``.

``string_imports`` reads the imports a module makes by name: ``importlib.import_module("longspan.x")``,
``__import__("longspan.x")`` and any other string constant that is a dotted path into a longspan module
(``"longspan.models.gpt_provider.GPTModelProvider"``, resolved later with importlib). They count for the
layering, not for the import cycles (they run when used, after every module has loaded).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "longspan"


@dataclass(frozen=True)
class ImportStatement:
    """One ``import`` / ``from ... import`` statement."""

    line: int
    end_line: int
    targets: frozenset[str]
    function_level: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_statements(tree: ast.AST, module: str, is_package: bool,
                      type_checking: bool = False) -> list[ImportStatement]:
    """The import statements of one module's tree (TYPE_CHECKING blocks excepted unless ``type_checking``)."""
    found: list[ImportStatement] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            for child in node.orelse:
                visit(child, in_function)
            return
        targets: set[str] = set()
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets.add(target)
            targets.update(f"{target}.{alias.name}" for alias in node.names)
        if targets:
            found.append(ImportStatement(node.lineno, node.end_lineno or node.lineno, frozenset(targets), in_function))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


_DOTTED = re.compile(r"^longspan(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def _docstring_ids(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (module, class, function, attribute docstrings)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for child in body if isinstance(body, list) else ():
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant) \
                    and isinstance(child.value.value, str):
                out.add(id(child.value))
    return out


def resolve_dotted(path: str, modules: dict[str, Path] | set[str]) -> str | None:
    """The longspan module a dotted path names: the path itself or its longest prefix that is a module
    (``longspan.models.gpt_provider.GPTModelProvider`` -> ``longspan.models.gpt_provider``)."""
    parts = path.split(".")
    for end in range(len(parts), 1, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def string_imports(tree: ast.AST, modules: dict[str, Path] | set[str]) -> list[tuple[int, str]]:
    """(line, longspan module) of every string constant in code (docstrings excepted) that is a dotted path into
    a longspan module: the arguments of ``importlib.import_module`` / ``__import__`` and paths kept for later."""
    docstrings = _docstring_ids(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value.strip()
            if _DOTTED.match(text):
                target = resolve_dotted(text, modules)
                if target is not None:
                    out.append((node.lineno, target))
    return sorted(set(out))


def longspan_modules() -> dict[str, Path]:
    """Module name -> file, for every module of longspan/."""
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def module_imports(name: str, path: Path, modules: dict[str, Path],
                   type_checking: bool = False) -> list[ImportStatement]:
    """The statements of module ``name`` with their targets narrowed to longspan modules (itself excepted)."""
    out = []
    for stmt in import_statements(parse(path), name, path.name == "__init__.py", type_checking):
        targets = frozenset(t for t in stmt.targets if t in modules and t != name)
        out.append(ImportStatement(stmt.line, stmt.end_line, targets, stmt.function_level))
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the longspan modules it imports (function-level imports included)."""
    modules = longspan_modules()
    return {
        name: {t for stmt in module_imports(name, path, modules) for t in stmt.targets}
        for name, path in modules.items()
    }
