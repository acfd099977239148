"""After every fault of a seeded storm, the whole live mount equals a fresh render.

`sandbox mount --daemon` serves a shipped profile's node (in the no-open fast mode when
the patched pyfuse3 is installed, as scripts/install and tox do); a seeded storm of
health, unplug, plug and set-vfs changes goes through the control socket, and after
each one every entry of the mount is read through the kernel (os-level calls: listings,
lstat, readlink, file bytes) and compared with the tree a fresh ``build_tree`` of the
states so far gives (the bytes ``sandbox render`` writes); every path seen so far is also
looked up by name, present or not. Kernel caches are warm the whole time, so a missed
invalidation (stale page, listing, attribute, negative entry or symlink) shows as a
difference.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandbox.agent import unmount
from sandbox.errors import ControlError
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.changes import next_state
from sandbox.fakehw.control import ControlClient
from sandbox.fakehw.control.scenario import apply_action, storm
from sandbox.fakehw.serve.fs import FAST_MODE_AVAILABLE
from sandbox.fakehw.tree import DeviceState
from sandbox.profile import load_profile
from tests.serve.test_fs_live import snapshot_mount, snapshot_tree
from tests.support.fakehw_toy import require_fuse
from tests.support.paths import REPO as ROOT

pytestmark = [pytest.mark.root, pytest.mark.fuse]

CASES = [("8gpu-2numa.yaml", "gpu-worker", 24), ("sriov-rdma.yaml", "net-worker", 24)]


def test_patched_pyfuse3_is_installed() -> None:
    assert FAST_MODE_AVAILABLE, (
        "pyfuse3 lacks hw-sandbox's patch (no FUSE fast mode): run "
        "scripts/build-pyfuse3 \"$(command -v python)\" in this environment"
    )


@pytest.mark.parametrize(("profile", "node_name", "changes"), CASES)
def test_every_file_matches_a_fresh_render_after_every_fault(
    tmp_path: Path, profile: str, node_name: str, changes: int
) -> None:
    require_fuse()
    node = load_profile(ROOT / "profiles" / profile).cluster.node(node_name)
    assert node is not None
    root = tmp_path / "root"
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "mount", str(ROOT / "profiles" / profile),
         "--node", node_name, str(root), "--daemon", "--state-dir", str(tmp_path),
         "--pid-file", str(tmp_path / "pid")],
        cwd=ROOT, text=True, capture_output=True, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    pid = int((tmp_path / "pid").read_text())
    try:
        states: dict[str, DeviceState] = {}
        assert snapshot_mount(root) == snapshot_tree(build_tree(node, states))  # warm
        devices = [d.id for d in node.devices]
        actions = storm(random.Random(f"{profile}/16"), start=0, changes=changes, over=0,
                        devices=devices, ops=("health", "unplug", "plug", "set-vfs"),
                        max_vfs=3)  # fmt: skip
        applied = 0
        seen: set[str] = set()
        with ControlClient(tmp_path / "control.sock") as client:
            for a in actions:
                assert a.change is not None
                try:
                    reply = apply_action(client, a.change)
                except ControlError:
                    continue  # refused as the kernel refuses it: nothing changed
                states[a.change.device] = next_state(
                    states.get(a.change.device, DeviceState()), a.change
                )
                applied += 1
                want = snapshot_tree(build_tree(node, states))
                # First by name, before any listing (a listing would replace stale negative
                # entries): paths that vanished are cached as negative entries and must
                # show again once they are back.
                seen |= want.keys()
                wrong = sorted(p for p in seen if os.path.lexists(root / p) != (p in want))
                assert not wrong, (a.change, reply, wrong[:10])
                got = snapshot_mount(root)
                wrong = sorted(p for p in want.keys() | got.keys() if want.get(p) != got.get(p))
                assert not wrong, (a.change, reply, wrong[:10])
        assert applied >= changes // 2
    finally:
        os.kill(pid, signal.SIGTERM)
        for _ in range(600):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            unmount(root)
            raise AssertionError(f"server {pid} did not exit within 30 s of SIGTERM")
