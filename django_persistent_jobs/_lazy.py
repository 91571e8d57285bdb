"""Lazy package exports (PEP 562), shared by the packages whose public names need the models.

A package listed in ``INSTALLED_APPS`` (or imported by one at start-up) must not import models
before the app registry is ready, so it names its exports here and imports each on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_getattr(
    package: str, exports: dict[str, str], namespace: dict[str, Any]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``exports`` maps a public name to the module
    (relative to ``package``) defining it; the value is cached in ``namespace`` (the package's
    ``globals()``) so later lookups do not come back here."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module, package), name)
        namespace[name] = value
        return value

    return __getattr__
