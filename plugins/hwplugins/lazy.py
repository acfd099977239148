"""Package ``__init__``s that import what they re-export on first use.

A package's ``__init__`` runs whenever any of its modules is imported, so re-exporting
from heavy modules there makes every light module of the package heavy: the FUSE server,
which needs only a resolved spec, paid for the YAML loader's pydantic model; every
`sandbox` command that read a status file, for the kubelet harness's gRPC; `sandbox up`,
for the device plugin's gRPC server when it asked the plugin's discovery for a count,
and for the whole DRA driver when it named the DRA device types. ``exports``
gives such a package a module ``__getattr__`` (PEP 562) that imports a name's module when
the name is first used. The package lists the same imports under ``TYPE_CHECKING`` for
type checkers, and its ``__all__`` as before (tests/test_lazy_imports.py checks the
exports against ``__all__``). It lives in hwplugins, which never imports the sandbox;
``sandbox.lazy`` is the same function for the sandbox's packages.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def exports(package: str, modules: Mapping[str, Sequence[str]]) -> Callable[[str], Any]:
    """``__getattr__`` for ``package``: ``modules`` maps a submodule (relative to the
    package, e.g. ``"loader"``) to the names it provides."""
    where = {name: f"{package}.{module}" for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:  # noqa: N807 - the PEP 562 hook's name
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)  # once: later lookups are plain
        return value

    __getattr__.exported = where  # type: ignore[attr-defined]
    return __getattr__
