"""Functions named by an import path, ``"package.module:function"``: how a DAG's settings name
a model's own code (a champion scorer, a serving check, a data check) and stay serializable."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def check_import_path(path: Any, what: str) -> str:
    """``path`` if it has the shape ``"package.module:function"``, else ValueError naming
    ``what`` (the setting) and what is allowed. Nothing is imported."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.partition(":")[::2]):
        raise ValueError(f"{what} must be an import path 'package.module:function', got {path!r}")
    return path


def import_callable(path: str, what: str) -> Callable[..., Any]:
    """The function ``path`` names, imported; ValueError naming ``what`` and the path when it
    does not import or is not callable."""
    module_name, _, attr = check_import_path(path, what).partition(":")
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{what} {path!r} does not import: {e}") from e
    if not callable(func):
        raise ValueError(f"{what} {path!r} is not callable")
    return func
