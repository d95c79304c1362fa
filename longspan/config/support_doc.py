"""Generate docs/config-support.md from the field-support table and the dataclass defaults.

Run ``python -m longspan.config.support_doc`` (writes docs/config-support.md) or with ``--check`` (exit 1
when the file is out of date).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

from longspan.config.schema.data import MockGPTDatasetConfig, T5MaskedWordPieceDatasetConfig
from longspan.config.schema.data_hf import ChatSFTPreprocessingConfig, HFDatasetSourceConfig
from longspan.config.schema.optim import MixedPrecisionConfig
from longspan.config.support import (
    NESTED_DATASET_CLASSES,
    NOT_SUPPORTED,
    SECTION_DEFAULT,
    SUPPORTED_DATASETS,
    REGISTERED_MODELS,
    field_status,
    not_supported_reason,
    supported_models,
)
from longspan.config.targets import section_types
from longspan.config.types import is_derived_field, yaml_fields
from longspan.core.plugins import load_plugins

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config-support.md"

# A class whose fields mostly repeat another's (a provider beside GPTModelProvider, a dataset beside
# GPTDatasetConfig) lists only the rows that differ from that table: its own fields and those whose default,
# status or meaning differ. Every field still has its row once.
SHARED_TABLE: dict[str, str] = {
    "T5ModelProvider": "GPTModelProvider",
    "MambaProvider": "GPTModelProvider",
    "MockGPTDatasetConfig": "GPTDatasetConfig",
    "T5MaskedWordPieceDatasetConfig": "GPTDatasetConfig",
}


def _section_classes() -> list[tuple[str, type]]:
    out: list[tuple[str, type]] = []
    for section, classes in section_types().items():
        for cls in classes:
            out.append((section, cls))
            if cls.__name__ == "GPTDatasetConfig":
                out.append((section, MockGPTDatasetConfig))
                out.append((section, T5MaskedWordPieceDatasetConfig))
            if cls.__name__ == "DirectHFSFTDatasetConfig":
                out.append((section, HFDatasetSourceConfig))
                out.append((section, ChatSFTPreprocessingConfig))
    out.append(("mixed_precision", MixedPrecisionConfig))
    return out


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings (string right after a field) of ``cls`` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                    if isinstance(nxt.value.value, str):
                        docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        if f.name == "local_rank":
            return "LOCAL_RANK (0)"
    else:
        return "(required)"
    if callable(value) and not isinstance(value, type):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__name__', value)}".replace(
            "torch._C._nn", "torch.nn.functional")
    return repr(value)


def _rows(section: str, cls: type) -> dict[str, str]:
    """Field name -> its table row, for every field of ``cls``."""
    docs = field_docs(cls)
    class_ok = section not in ("model", "dataset") or cls.__name__ in (
        supported_models() + SUPPORTED_DATASETS + NESTED_DATASET_CLASSES)
    rows: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        if is_derived_field(f):
            status = "derived by validate()"
        elif f not in yaml_fields(cls):
            status = "runtime object (set by longspan, never in YAML)"
        else:
            status = field_status(section, f.name, cls.__name__) if class_ok else f"{NOT_SUPPORTED} (the class)"
            reason = not_supported_reason(section, f.name, cls.__name__) if status == NOT_SUPPORTED else None
            if reason:
                status = f"{NOT_SUPPORTED}: {reason}"
        meaning = docs.get(f.name, "").replace("|", "\\|")
        rows[f.name] = f"| `{f.name}` | `{_default(f)}` | {status} | {meaning} |"
    return rows


def render() -> str:
    """The full Markdown text."""
    load_plugins()  # the registered model classes are named in the introduction
    lines = [
        "# Configuration support",
        "",
        "Generated by `python -m longspan.config.support_doc` from `longspan/config/support.py` and the",
        "config dataclasses; do not edit by hand.",
        "",
        "- **supported**: longspan implements the field.",
        "- **not supported yet**: `validate()` stops with a one-line error when the field is set to anything",
        "  but its default; the row says why (the same reason ends the error).",
        "- **device-dependent**: implemented where it applies; on a machine without an accelerator it has no",
        "  effect and start-up lists it once in a 'not applicable on this machine' line.",
        "- **performance hint (no effect)**: a Megatron/Transformer Engine performance switch (kernel fusion,",
        "  implementation choice, communication scheduling) that changes no maths; longspan uses torch's kernels,",
        "  accepts the field and lists it once at start-up when it is on.",
        "",
        "Model classes that can be built: GPTModelProvider, T5ModelProvider (longspan.models.t5), MambaProvider",
        f"(longspan.models.mamba), {', '.join(REGISTERED_MODELS)} (the model families' own providers:",
        "longspan.families); each provider after GPTModelProvider lists only the fields whose default, status or",
        "meaning differ from GPTModelProvider's table, and a value one family does not implement stops the build",
        "with a one-line error. Datasets: GPTDatasetConfig, MockGPTDatasetConfig,",
        "T5MaskedWordPieceDatasetConfig (T5 span corruption: longspan.data.t5_dataset) and",
        "FinetuningDatasetConfig (SFT JSONL data, packed sequences: longspan.data.sft) and DirectHFSFTDatasetConfig",
        "(JSONL/JSON/Parquet/CSV/save_to_disk data in the shapes of TRL, ShareGPT and Alpaca, read through `datasets`:",
        "longspan.data.sft.hf_dataset; its nested HFDatasetSourceConfig and ChatSFTPreprocessingConfig have tables",
        "below). `peft` takes LoRA, DoRA or CanonicalLoRA (longspan.peft); `comm_overlap` takes Megatron Bridge's",
        "CommOverlapConfig fields and sets the model, ddp and optimizer fields they name (longspan.config.rules.comm_overlap).",
        "",
    ]
    rendered: dict[str, dict[str, str]] = {}
    for section, cls in _section_classes():
        rows = _rows(section, cls)
        rendered[cls.__name__] = rows
        base = SHARED_TABLE.get(cls.__name__) or REGISTERED_MODELS.get(cls.__name__)
        intro = f"Fields not listed in the table of exceptions default to **{SECTION_DEFAULT[section]}**."
        if base in rendered:
            shared = [name for name, row in rows.items() if rendered[base].get(name) == row]
            rows = {name: row for name, row in rows.items() if name not in shared}
            intro += (f" The {len(shared)} fields it shares with {base} (same default, status and meaning) are "
                      f"listed there; this table has the rest.")
        lines += [f"## `{section}`: {cls.__name__}", "", intro, "",
                  "| field | default | status | meaning |", "| --- | --- | --- | --- |", *rows.values(), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Write the document, or with --check report whether it is current."""
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else ""
        if current != text:
            sys.stderr.write(f"{DOC_PATH} is out of date: run python -m longspan.config.support_doc\n")
            return 1
        return 0
    DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
    DOC_PATH.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
