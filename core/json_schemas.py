"""The contract's JSON files as JSON Schema (draft 2020-12), derived from their one
declaration in :mod:`horovod_airflow.core.contract`, for programs that write or read them
without importing this package: a training program in another language or image that writes
``metrics.json``, an exporter that writes ``parity.json``, a serving system that follows
``latest.json``.

The files are generated, never edited: ``docs/contract/`` holds them, and
``tests/test_contract.py`` fails when they differ from what this module writes::

    python -m horovod_airflow.core.json_schemas docs/contract

What a JSON Schema validator accepts, :meth:`Schema.check` accepts, with one difference
JSON Schema cannot express: ``check`` refuses a float where an integer is declared (``1.0``
for ``epochs``), while JSON Schema's ``integer`` takes any number with a zero fraction. Each
file says so in its ``$comment``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from horovod_airflow.core.contract import (
    GATE,
    LATEST,
    METRICS,
    NUMBER,
    PARITY,
    PREPROCESSING,
    PROMOTION,
    STEP_SERIES,
    VERSION_MANIFEST,
    Schema,
)

DRAFT = "https://json-schema.org/draft/2020-12/schema"

#: The schema file of each contract document: ``<name>.schema.json`` in the output folder.
SCHEMAS: dict[str, Schema] = {
    "metrics": METRICS,
    "steps": STEP_SERIES,
    "parity": PARITY,
    "gate": GATE,
    "version-manifest": VERSION_MANIFEST,
    "latest": LATEST,
    "promotion": PROMOTION,
    "preprocessing": PREPROCESSING,
}

_TYPES: dict[Any, str] = {
    NUMBER: "number",
    int: "integer",
    bool: "boolean",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}

COMMENT = (
    "Generated from horovod_airflow.core.contract by `python -m "
    "horovod_airflow.core.json_schemas`; do not edit. Where this schema says integer, the "
    "contract's own check also refuses a number written with a fraction (1.0)."
)


def _type(kind: Any, *, nullable: bool) -> list[str] | str:
    kinds = list(kind) if isinstance(kind, tuple) else [kind]
    names = [_TYPES[k] for k in kinds]
    if nullable and "null" not in names:
        names.append("null")
    return names[0] if len(names) == 1 else names


def json_schema(schema: Schema) -> dict[str, Any]:
    """``schema`` as a JSON Schema document: an object with a ``format`` it supports (the
    current one or a legacy one still read), the keys required for that format, each key's
    type (an optional key may also be null), and any other keys allowed, as ``check`` allows
    them."""
    properties: dict[str, Any] = {"format": {"enum": list(schema.supported)}}
    for key, kind in schema.required.items():
        properties[key] = {"type": _type(kind, nullable=False)}
    for key, kind in schema.optional.items():
        properties[key] = {"type": _type(kind, nullable=True)}
    per_format = []
    for fmt in schema.supported:
        may_lack = set(schema.legacy.get(fmt, ()))
        required = [k for k in schema.required if k not in may_lack]
        if required:
            per_format.append(
                {
                    "if": {"properties": {"format": {"const": fmt}}},
                    "then": {"required": required},
                }
            )
    document: dict[str, Any] = {
        "$schema": DRAFT,
        "$comment": COMMENT,
        "title": f"{schema.name} ({schema.format})",
        "type": "object",
        "required": ["format"],
        "properties": properties,
    }
    if per_format:
        document["allOf"] = per_format
    return document


def render(schema: Schema) -> str:
    """The text of ``schema``'s file: :func:`json_schema`, indented, one newline at the end."""
    return json.dumps(json_schema(schema), indent=2) + "\n"


def write(folder: Path) -> list[Path]:
    """Write every contract document's schema into ``folder``; the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, schema in SCHEMAS.items():
        path = folder / f"{name}.schema.json"
        path.write_text(render(schema))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m horovod_airflow.core.json_schemas",
        description="Write the JSON Schema of each contract file (metrics.json, parity.json, "
        "latest.json, ...) into a folder, as <name>.schema.json.",
    )
    parser.add_argument("folder", type=Path, help="where to write them (docs/contract)")
    args = parser.parse_args(argv)
    for path in write(args.folder):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
