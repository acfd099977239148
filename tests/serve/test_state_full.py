"""`sandbox up` on a state root that fills up during bring-up (issue 21, item 9).

The state root is a real tmpfs this small, so the ``No space left on device`` comes from
the kernel at whatever write overflows it: the marker or ``sandbox.json.tmp`` of the
first record (4 KiB: the marker takes the only page), a log or the record after the
kubelet harness, the mount or the plugin has been started. Each time: one ``error:``
line, exit 1, no traceback, and nothing of the sandbox left (no entry in the state root,
no FUSE mount, no process).
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.test_up_signals import NAME, PROFILE, cli, error_lines, leftovers, scrub
from tests.support.fakehw_toy import require_fuse

pytestmark = [pytest.mark.root, pytest.mark.fuse]

# KiB. The whole local sandbox of PROFILE takes some 56 KiB on tmpfs (spec.json alone 21
# KiB); each of these fills during `up`, at one step or another.
SIZES = [4, 8, 12, 16, 24, 32, 36, 40, 44]


@pytest.fixture
def small_root(request: pytest.FixtureRequest) -> Iterator[Path]:
    size = int(request.param)
    d = Path(tempfile.mkdtemp(prefix="hwf-", dir="/tmp"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}k,mode=0755",
                              "hwsandbox-test", str(d)], capture_output=True, text=True,
                             check=False)
    if mounted.returncode != 0:
        d.rmdir()
        pytest.fail(f"needs root to mount a tmpfs: {mounted.stderr.strip()}", pytrace=False)
    try:
        yield d
    finally:
        try:
            scrub(d)
        finally:
            subprocess.run(["umount", str(d)], capture_output=True, check=False)
            if Path("/proc/mounts").read_text().count(f" {d} "):
                subprocess.run(["umount", "-l", str(d)], capture_output=True, check=False)
            d.rmdir()


@pytest.mark.parametrize("small_root", SIZES, indirect=True, ids=[f"{s}k" for s in SIZES])
def test_full_state_root(small_root: Path) -> None:
    require_fuse()
    up = cli(small_root, "up", PROFILE, "--runtime", "local")
    assert "Traceback" not in up.stderr, up.stderr
    assert up.returncode == 1, up.stdout + up.stderr
    [line] = error_lines(up.stderr)
    assert "No space left on device" in line, line
    assert "warning" not in up.stderr, up.stderr  # the clean-up was complete
    assert leftovers(small_root) == [], up.stderr
    down = cli(small_root, "down", "--name", NAME)  # nothing left: a note, exit 0
    assert down.returncode == 0, down.stderr
    assert f"no sandbox named {NAME!r}: nothing to remove" in down.stderr, down.stderr
