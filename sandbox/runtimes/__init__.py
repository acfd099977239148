"""Runtimes: where a sandbox's nodes run. See ``base`` for the interface.

    local   FUSE trees + our plugins + the kubelet harness, no Kubernetes (always works)
    native  a real single-node Kubernetes built from source, as host processes
    kind    kind clusters in Docker (needs a Docker daemon, kind and a node image)
"""

from __future__ import annotations

import importlib
from typing import Any

from sandbox.errors import SandboxError
from sandbox.runtimes.base import Runtime

RUNTIMES = {
    "local": ("sandbox.runtimes.local", "LocalRuntime"),
    "native": ("sandbox.runtimes.native", "NativeRuntime"),
    "kind": ("sandbox.runtimes.kind", "KindRuntime"),
}


def runtime_for(name: str, **options: Any) -> Runtime:
    """The runtime ``name``, made with ``options`` (keywords of the runtime's class:
    ``reference_plugin``, ``emulate_topology``, ``plugin_options``, ``feature_gates``,
    ``dra_options``, ``dra_driver``); OptionRefused for one it does not have."""
    try:
        module, cls = RUNTIMES[name]
    except KeyError:
        raise SandboxError(f"unknown runtime {name!r} (have: {', '.join(RUNTIMES)})") from None
    try:
        runtime: Runtime = getattr(importlib.import_module(module), cls)(**options)
    except (ImportError, AttributeError) as exc:
        raise SandboxError(f"runtime {name!r} is not available in this build: {exc}") from exc
    return runtime


def choose_runtime(**options: Any) -> tuple[Runtime, str]:
    """The default runtime here, and why: kind where it can run, else local (made with
    ``options``, as ``runtime_for``)."""
    try:
        kind = runtime_for("kind", **options)
        reason = kind.unavailable_reason()
    except SandboxError as exc:
        reason = str(exc)
    else:
        if reason is None:
            return kind, "Docker and kind are available"
    # Only why, not how to fix it: the local runtime is a fine answer, and an `up` that then
    # fails for another reason must not read as if kind were the trouble.
    why = str(reason).split("; ")[0]
    return runtime_for("local", **options), (
        f"kind is not usable here: {why} (`sandbox up --runtime kind` says what it needs)")
