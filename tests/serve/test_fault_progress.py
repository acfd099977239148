"""`sandbox fault run` says how far it is while it waits, not only after a change."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.fakehw.control import ControlClient
from tests.support.fakehw_toy import Server, start_server
from tests.support.paths import REPO

pytestmark = [pytest.mark.root, pytest.mark.fuse]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = start_server(tmp_path / "root")
    try:
        yield srv
        assert srv.unmount() == 0
    finally:
        srv.cleanup()


def test_a_long_wait_reports_progress_on_a_timer(server: Server, tmp_path: Path) -> None:
    scenario = tmp_path / "gap.yaml"
    scenario.write_text("steps:\n"
                        "  - {at: 0, do: unplug, device: gpu0}\n"
                        "  - {at: 3.5, do: plug, device: gpu0,\n"
                        "     expect: {gpu0: {plugged: true}}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "fault", "--socket", str(server.socket), "run",
         str(scenario), "--progress", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    # the gap (3.5 s) is longer than the interval (1 s): at least one line while waiting,
    # after the first change and before the second
    waiting = [line for line in result.stderr.splitlines()
               if line.startswith("  1 of 2 change(s) applied at ") and
               line.endswith("s; next at 3.5s (steps[1])")]
    assert waiting, result.stderr
    assert "2 change(s) applied, 1 of 1 expectation(s) met" in result.stdout
    quiet = subprocess.run(
        [sys.executable, "-m", "sandbox", "fault", "--socket", str(server.socket), "run",
         str(scenario), "--progress", "0", "--speed", "4"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert quiet.returncode == 0, quiet.stderr
    assert "change(s) applied at" not in quiet.stderr
    with ControlClient(server.socket) as c:
        assert c.devices()["gpu0"]["state"]["plugged"] is True
