"""Every import statement of longspan/, read with ``ast`` (nothing is imported): the shared reader of the
import-cycle and layering tests.

An import names the longspan modules it points at: ``import a.b`` points at ``a.b``; ``from pkg import name``
points at ``pkg`` and at ``pkg.name`` (kept only when that is a module). Imports under ``if TYPE_CHECKING:`` are
left out (they never run); imports inside functions are kept and marked ``function_level``.
"""

from __future__ import annotations

import ast
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


def import_statements(tree: ast.AST, module: str, is_package: bool) -> list[ImportStatement]:
    """The import statements of one module's tree (TYPE_CHECKING blocks excepted)."""
    found: list[ImportStatement] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
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


def longspan_modules() -> dict[str, Path]:
    """Module name -> file, for every module of longspan/."""
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def module_imports(name: str, path: Path, modules: dict[str, Path]) -> list[ImportStatement]:
    """The statements of module ``name`` with their targets narrowed to longspan modules (itself excepted)."""
    out = []
    for stmt in import_statements(parse(path), name, path.name == "__init__.py"):
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
