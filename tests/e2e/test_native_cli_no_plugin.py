"""`sandbox up --runtime native --no-device-plugin`, as a user runs it before deploying a
third-party plugin: the node serves its fake hardware and is Ready, but nothing advertises
it (no reference plugin socket, no ``nvidia.com/gpu`` on the node) until that plugin comes;
`sandbox down` removes it all. A kubelet root left by a native sandbox killed before its
`down` (our marker, its plugins' sockets) is made afresh by this `up`, and removed by its
`down`.

The real CLI in a state root of its own; the session's shared cluster is taken down first
(one native cluster at a time: it owns /var/lib/kubelet).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from cluster import PROFILE
from conftest import Sandboxes

from sandbox.runtimes.native import bin_dir, kubelet_root
from tests.support.thirdparty import short_dir

NAME = "cli-no-plugin"


def _sandbox(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True,
                          text=True, timeout=600, check=False, env=env)  # fmt: skip


def test_up_without_the_reference_plugin(sandboxes: Sandboxes, tmp_path: Path) -> None:
    sandboxes.release()
    # a state root too deep for containerd's sockets is refused before anything is made
    deep = tmp_path / ("d" * 60)
    refused = _sandbox(dict(os.environ, HWSANDBOX_STATE_DIR=str(deep)), "up", str(PROFILE),
                       "--runtime", "native", "--name", NAME)
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "error: sandbox up failed at step 'check': the state dir "), refused.stderr
    assert "too deep for containerd's sockets" in refused.stderr, refused.stderr
    assert not (deep / NAME).exists()
    # a prefix scripts/test's HWSANDBOX_TEST_BESIDE covers (kind's mount check beside it)
    with short_dir("hwsb-e2e-cli-") as root:
        _up_without_the_plugin(root)


def _left_by_a_dead_sandbox() -> list[Path]:
    """A kubelet root as a native sandbox killed before its `down` leaves it: our marker,
    and its plugins' sockets (bound, never unlinked)."""
    from sandbox.runtimes.native.cleanup import CREATED_MARKER

    kubelet = kubelet_root()
    assert not kubelet.exists(), f"{kubelet} is there with no native sandbox running"
    stale = [kubelet / "device-plugins" / "gone-plugin.sock",
             kubelet / "plugins_registry" / "gone-driver-reg.sock"]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))
    (kubelet / CREATED_MARKER).write_text("made by `sandbox up --runtime native`\n")
    return stale


def _up_without_the_plugin(root: Path) -> None:
    env = dict(os.environ, HWSANDBOX_STATE_DIR=str(root))
    stale = _left_by_a_dead_sandbox()
    up = _sandbox(env, "up", str(PROFILE), "--runtime", "native", "--no-device-plugin",
                  "--name", NAME)
    try:
        assert up.returncode == 0, up.stderr
        # the dead sandbox's kubelet root is made afresh: none of its sockets is left
        assert "left by an earlier native sandbox that is gone" in up.stderr, up.stderr
        assert not any(p.exists() for p in stale), [p for p in stale if p.exists()]
        assert not any((kubelet_root() / "plugins_registry").glob("*.sock"))
        assert "sandbox kubeconfig" in up.stdout, up.stdout  # up's "Next:" lines
        # `sandbox kubeconfig` as a user gets it: the path, the text, a copy for kubectl
        path = _sandbox(env, "kubeconfig", "--name", NAME, "--path")
        assert path.returncode == 0, path.stderr
        assert Path(path.stdout.strip()) == root / NAME / "kubeconfig"
        printed = _sandbox(env, "kubeconfig", "--name", NAME)
        assert printed.returncode == 0, printed.stderr
        assert printed.stdout == (root / NAME / "kubeconfig").read_text()
        kubeconfig = root / "copied.kubeconfig"
        wrote = _sandbox(env, "kubeconfig", "--name", NAME, "--write", str(kubeconfig))
        assert wrote.returncode == 0, wrote.stderr
        assert kubeconfig.stat().st_mode & 0o777 == 0o600
        node = json.loads(subprocess.run(
            [str(bin_dir() / "kubectl"), "--kubeconfig", str(kubeconfig), "get", "node",
             "gpu-worker", "-o", "json"], capture_output=True, text=True, check=True,
            timeout=60).stdout)  # fmt: skip
        ready = [c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready == ["True"], node["status"]["conditions"]
        assert "nvidia.com/gpu" not in node["status"]["capacity"], node["status"]["capacity"]
        sockets = sorted(p.name for p in (kubelet_root() / "device-plugins").iterdir())
        assert sockets == ["kubelet.sock"], sockets
        # the fake hardware is there for a plugin to find
        nvidia = root / NAME / "node-root" / "sys" / "bus" / "pci" / "drivers" / "nvidia"
        assert len([p for p in nvidia.iterdir() if p.name.startswith("0000:")]) == 8
        status = _sandbox(env, "status", "--name", NAME)
        assert status.returncode == 0, status.stderr
        assert "gpu-worker" in status.stdout, status.stdout
    finally:
        down = _sandbox(env, "down", "--name", NAME)
    assert down.returncode == 0, down.stderr
    assert not (root / NAME).exists()
    assert not kubelet_root().exists(), "down left the kubelet root it made"
    again = _sandbox(env, "down", "--name", NAME)  # a teardown step after a failed run
    assert again.returncode == 0, again.stderr
    assert "nothing to remove" in again.stderr
