"""Go programs the tests build from their modules into a cache outside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("HWSANDBOX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hw-sandbox")
    return Path(base)


def go_install(module: str, version: str, binary: str) -> Path:
    """``go install module@version`` into the cache (once); the binary's path.

    Fails the calling test with an install hint when Go is missing.
    """
    target = cache_root() / "tools" / f"{binary}-{version}"
    exe = target / binary
    if exe.is_file():
        return exe
    go = shutil.which("go") or next(
        (p for p in ("/usr/local/go/bin/go",) if os.access(p, os.X_OK)), None)  # go.dev's place
    if go is None:
        raise AssertionError(
            f"building {module}@{version} needs the Go toolchain: install Go >= 1.24 "
            "(https://go.dev/doc/install) and put `go` on PATH")
    target.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GOBIN": str(target), "GOFLAGS": "-p=2", "CGO_ENABLED": "0"}
    result = subprocess.run([go, "install", f"{module}@{version}"], env=env,
                            capture_output=True, text=True, check=False, timeout=1800)
    assert result.returncode == 0, f"go install {module}@{version} failed:\n{result.stderr}"
    return exe
