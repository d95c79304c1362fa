"""A model family lives in its package: outside ``longspan/families/<name>*`` its name appears in at most
``MAX_FILES_OUTSIDE`` code files (identifiers and strings; comments and docstrings do not count).

The registry (``longspan/families/__init__.py``) names every family; the other allowed places are the few shared
spots that must (e.g. the export fallback for checkpoints without a family record). Model kinds (GPT, T5, Mamba)
and shared blocks (MLA, mRoPE, the Mamba mixer) are not families.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

import pytest

from tests.code.import_graph import ROOT

MAX_FILES_OUTSIDE = 3

# family -> (pattern over code tokens, its packages under longspan/families/)
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    # 'llama3' alone is HF's name of a RoPE scaling method (a shared block), not the family
    "Llama": (r"llama(?!3['\"])", ("llama",)),
    "Qwen": (r"qwen", ("qwen", "qwen_vl", "qwen3_vl", "qwen35", "qwen3_next")),
    "Gemma": (r"gemma", ("gemma", "gemma_vl", "gemma4")),
    "DeepSeek": (r"deepseek", ("deepseek",)),
    "GLM": (r"glm", ("glm",)),
    "Nemotron": (r"nemotron", ("nemotron",)),
    "GPT-OSS": (r"gpt[_-]?oss", ("gpt_oss",)),
    "OLMo": (r"olmo", ("olmo", "olmoe")),
    "Phi": (r"(?<![a-z])phi[-_]?3|(?<![a-z])phi(?![a-z])", ("phi",)),
    "Mistral": (r"mistral|ministral", ("mistral",)),
    "Mixtral": (r"mixtral", ("mixtral",)),
    "MiniMax": (r"minimax", ("minimax",)),
    # GPT2BPETokenizer is Megatron's tokenizer type, not the model family
    "GPT-2": (r"gpt[-_]?2(?!\d|bpe)", ("gpt2",)),
}


def _docstring_positions(tree: ast.AST) -> set[tuple[int, int]]:
    """Where docstrings and attribute docstrings (a bare string statement) start."""
    out = set()
    for node in ast.walk(tree):
        for stmt in getattr(node, "body", []) if isinstance(getattr(node, "body", None), list) else []:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                out.add((stmt.lineno, stmt.col_offset))
    return out


def code_text(source: str) -> str:
    """The identifiers and string literals of ``source`` (no comments, no docstrings), lower case."""
    docs = _docstring_positions(ast.parse(source))
    parts = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING and tok.start in docs:
            continue
        if tok.type in (tokenize.NAME, tokenize.STRING) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            parts.append(tok.string)
    return " ".join(parts).lower()


@functools.lru_cache(maxsize=None)
def _code_of(path: Path) -> str:
    return code_text(path.read_text(encoding="utf-8"))


def files_naming(pattern: str, own: tuple[str, ...]) -> list[str]:
    """The code files outside ``own`` family packages whose code names the family."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "families" and len(rel.parts) > 2 and rel.parts[1] in own:
            continue
        if re.search(pattern, _code_of(path)):
            out.append(str(rel))
    return out


def test_code_text_skips_comments_and_docstrings() -> None:
    source = '"""Qwen docs."""\nx = 1  # qwen\ny = "Qwen3ForCausalLM"\n'
    assert "qwen" not in code_text(source).replace("qwen3forcausallm", "")
    assert "qwen3forcausallm" in code_text(source)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_is_named_in_few_files_outside_its_package(family: str) -> None:
    pattern, own = FAMILIES[family]
    found = files_naming(pattern, own)
    assert len(found) <= MAX_FILES_OUTSIDE, (
        f"{family} is named in {len(found)} code files outside longspan/families/{{{','.join(own)}}} "
        f"(at most {MAX_FILES_OUTSIDE}):\n" + "\n".join(found))


def test_no_dispatch_on_class_names() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr == "__name__"
                       and isinstance(s.value, ast.Call) and getattr(s.value.func, "id", None) == "type"
                       for s in sides):
                    found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not found, "type(x).__name__ compared (dispatch on a class name; use isinstance or the registry):\n" + \
        "\n".join(found)
