"""Running the installed ``sandbox`` console script in tests, as a user types it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.paths import REPO


def console_script() -> Path:
    """The ``sandbox`` that ``pip install`` put beside this interpreter."""
    script = Path(sys.executable).parent / "sandbox"
    if not script.is_file():
        pytest.fail(f"no console script at {script}: install the project into this "
                    "interpreter's environment (pip install -e '.[test]', or run the tests "
                    "with scripts/test)", pytrace=False)
    return script


def state_roots() -> Iterator[Path]:
    """For a ``state_root`` fixture: a fresh state root (HWSANDBOX_STATE_DIR) whose
    sandboxes are taken down at the end, even those a failed test left."""
    d = Path(tempfile.mkdtemp(prefix="hws-", dir="/tmp"))  # short: socket paths
    try:
        yield d
    finally:
        for record in d.glob("*/sandbox.json"):  # a failed test must not leak a sandbox
            subprocess.run([str(console_script()), "down", "--name", record.parent.name],
                           env=_env(d), capture_output=True, check=False, timeout=120)
        shutil.rmtree(d, ignore_errors=True)


def _env(state_root: Path | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    if state_root is not None:
        env["HWSANDBOX_STATE_DIR"] = str(state_root)
    return env


def sandbox(*args: str, stdin: str | None = None, cwd: Path = REPO,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(console_script()), *args], input=stdin, text=True,
                          capture_output=True, check=False, timeout=120, cwd=cwd,
                          env=env or _env())


def build_wheel(where: Path) -> Path:
    """The project's wheel, built as ``pip install`` builds it, from a copy of the tree
    (building in the checkout would leave build/ and *.egg-info there)."""
    source, wheels = where / "source", where / "wheels"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", ".*cache", ".tox", ".hypothesis", "__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                            "--disable-pip-version-check", "-w", str(wheels), str(source)],
                           capture_output=True, text=True, check=False, timeout=600)
    assert built.returncode == 0, built.stderr
    [wheel] = wheels.glob("hw_sandbox-*.whl")
    return wheel
