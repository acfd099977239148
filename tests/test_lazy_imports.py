"""Start-up cost, checked without timing: packages that re-export on first use
(``sandbox.lazy``) export exactly their ``__all__``, and the light modules the FUSE
server, `sandbox up` and the status readers import do not pull in the heavy ones (the
YAML loader's pydantic, gRPC, trio, pyfuse3). benchmarks/bench_up.py measures the time."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys

import pytest

LAZY = ["sandbox.agent", "sandbox.fakehw", "sandbox.kubelet", "sandbox.profile",
        "hwplugins.deviceplugin", "hwplugins.dra"]


@pytest.mark.parametrize("package", LAZY)
def test_a_lazy_package_exports_its_all_and_nothing_else(package: str) -> None:
    module = importlib.import_module(package)
    exported: dict[str, str] = module.__getattr__.exported  # name -> its module
    eager = {n for n in module.__all__ if n in vars(module) and n not in exported}
    assert set(exported) | eager == set(module.__all__)
    for name, where in exported.items():  # each is its module's object
        # (a submodule of the same name would replace it once imported: fakehw.render)
        assert importlib.util.find_spec(f"{package}.{name}") is None, name
        assert getattr(module, name) is getattr(importlib.import_module(where), name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        _ = module.no_such_name


def _loaded(imports: str) -> list[str]:
    """The heavy modules a fresh interpreter has loaded after ``imports``."""
    code = (f"import json, sys; {imports}; print(json.dumps(sorted(m for m in "
            "('pydantic', 'yaml', 'grpc', 'trio', 'pyfuse3', 'sandbox.fakehw.builder') "
            "if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    loaded: list[str] = json.loads(out)
    return loaded


@pytest.mark.parametrize(("imports", "allowed"), [
    # what the FUSE server needs to build a tree from a resolved spec
    ("import sandbox.profile.spec, sandbox.profile.devnames, sandbox.fakehw.builder",
     ["sandbox.fakehw.builder"]),
    # what `sandbox up --runtime local` needs besides the YAML loader
    ("import sandbox.runtimes.local", []),
    ("import sandbox.kubelet.status, sandbox.fakehw.states, sandbox.agent.spawn", []),
    # the loader itself: pydantic and YAML, still no server or gRPC
    ("from sandbox.profile import load_profile", ["pydantic", "yaml"]),
    # `sandbox up`'s command, which names the DRA driver's device types, and the device
    # plugin's discovery it asks for a count: no DRA driver, no plugin server
    ("import sandbox.cli.up; from hwplugins.deviceplugin import discover",
     ["pydantic", "yaml"]),
])  # fmt: skip
def test_light_modules_do_not_import_heavy_ones(imports: str, allowed: list[str]) -> None:
    assert _loaded(imports) == allowed
