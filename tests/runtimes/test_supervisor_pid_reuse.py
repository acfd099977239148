"""A pid the kernel hands to an unrelated process after ours died is never signalled, and
never reported as ours, on the path the native runtime takes: processes spawned through
``sandbox.supervisor`` and recorded by ``native.common.spawn`` (pid + start time), read
back by ``status`` (``native.common.running``), ``restart_kubelet`` and ``down``'s steps
(``native.common.stop`` -> ``supervisor.stop``). The local runtime's path is
tests/runtimes/test_local_runtime.py::test_a_reused_pid_is_never_signalled."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.runtimes.native.common import EXTRAS, ORDER
from tests.support.paths import REPO as ROOT

pytestmark = [pytest.mark.root]


def test_native_records_of_reused_pids_are_never_signalled(tmp_path: Path) -> None:
    """Every process the native runtime records is killed and its pid handed to a
    ``sleep`` (ns_last_pid in a pid namespace of our own): status reports each as not
    running, restart-kubelet starts a new kubelet without signalling the old pid's new
    owner, and down stops that new kubelet and nothing else."""
    if shutil.which("unshare") is None:
        pytest.fail("needs unshare (apt-get install util-linux)")
    if os.geteuid() != 0:
        pytest.fail("needs root: a pid namespace and /proc/sys/kernel/ns_last_pid "
                    "(run the tests as root, e.g. in the dev container)")
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc",
         sys.executable, str(ROOT / "tests" / "support" / "native_pid_reuse_probe.py"),
         str(tmp_path / "pid-reuse")],
        cwd=ROOT, text=True, capture_output=True, check=False, timeout=300)
    assert probe.returncode == 0, probe.stderr
    out = json.loads(probe.stdout.strip().splitlines()[-1])
    names = [*ORDER, *EXTRAS]
    assert out["ours_before"] == dict.fromkeys(names, True), out
    assert not any("not running" in n for n in out["notes_before"]), out["notes_before"]
    assert "not_dead" not in out, "a SIGKILLed process did not go away"
    assert out["reused"] == dict.fromkeys(names, True), "could not hand the pids on"
    # Each record names a live pid now, but not our process.
    assert out["same_process"] == dict.fromkeys(names, False), out["same_process"]
    assert out["loaded_running"] == dict.fromkeys(names, False), out["loaded_running"]
    assert out["running"] == dict.fromkeys(names, False), out["running"]
    notes = "\n".join(out["notes"])
    for name in ORDER:
        assert f"{name} is not running" in notes, notes
    assert "the DRA driver is not running" in notes, notes
    assert any("cannot read node" in n for n in out["notes_no_api"]), out["notes_no_api"]
    assert out["restart"] == "ok", out["restart"]
    new = out["new_kubelet"]
    assert new is not None, out
    assert new["running"], new
    assert new["pid"] != new["old_pid"], new
    assert out["alive_after_restart"] == dict.fromkeys(names, True), "restart-kubelet signalled"
    assert out["down_problems"] == [], out["down_problems"]
    assert out["new_kubelet_stopped"], "down left the kubelet restart-kubelet started"
    assert out["pid_files_left"] == [], out["pid_files_left"]
    assert out["stranger_alive"] == dict.fromkeys(names, True), (
        "a process that merely reused a pid of ours was signalled")
