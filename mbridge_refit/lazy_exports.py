"""Lazy public names for a package's ``__init__``: each name is imported from its module on first use.

Importing Megatron-Bridge takes seconds; a package that re-exports names from modules that import
it (``mbridge_refit``, ``mbridge_refit.convert``) would make every import of the package, and the
CLI's ``--help``, wait for it. ``lazy_getattr`` is the module-level ``__getattr__`` (PEP 562) that
defers each import to the first access of its name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_getattr", "public_names"]


def public_names(public: Mapping[str, Iterable[str]]) -> list[str]:
    """The names a lazy table gives (``public``: a module's dotted name -> the names it gives),
    sorted: the package's ``__all__``."""
    return sorted(name for names in public.values() for name in names)


def lazy_getattr(package: str, public: Mapping[str, Iterable[str]]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``package`` that imports the module ``public`` lists a name under (a
    module's dotted name -> the names it gives) and returns its attribute of that name; other names
    raise ``AttributeError`` as Python's own would."""
    module_of = {name: module for module, names in public.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
