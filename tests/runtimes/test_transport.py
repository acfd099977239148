"""The exec transport's pieces that need no cluster: ``python -m sandbox.relay`` joined to
a real unix socket server, and how a transport is chosen. The relay through an agent pod
is tests/kind_e2e/test_kind.py::test_exec_transport_behaves_as_the_host_socket."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox.agent import unmount
from sandbox.errors import SandboxError
from sandbox.fakehw.control.client import ControlClient
from sandbox.runtimes.kind import transport
from tests.support.fakehw_toy import require_fuse

REPO = Path(__file__).resolve().parents[2]


def _echo_server(path: Path, replies: list[bytes]) -> threading.Thread:
    """Serve one connection: read until the peer's end, then answer with everything read
    reversed (so the relay must carry the half-close and the answer after it)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            got = b""
            while chunk := conn.recv(65536):
                got += chunk
            replies.append(got)
            conn.sendall(got[::-1])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _relay(path: Path, data: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "sandbox.relay", str(path)], input=data,
                          capture_output=True, cwd=REPO, timeout=60, check=False)


def test_relay_copies_bytes_both_ways(tmp_path: Path) -> None:
    data = bytes(range(256)) * 4096 + b"\n\r\x00end"  # 1 MiB of every byte value
    got: list[bytes] = []
    server = _echo_server(tmp_path / "s", got)
    proc = _relay(tmp_path / "s", data)
    server.join(30)
    assert proc.returncode == 0, proc.stderr
    assert got == [data]
    assert proc.stdout == data[::-1]


def test_relay_refuses_a_missing_socket(tmp_path: Path) -> None:
    proc = _relay(tmp_path / "nothing", b"")
    assert proc.returncode == 1
    assert proc.stderr.decode().strip() == (
        f"relay: cannot connect to {tmp_path / 'nothing'}: No such file or directory")
    usage = subprocess.run([sys.executable, "-m", "sandbox.relay"], capture_output=True,
                           text=True, cwd=REPO, check=False)
    assert usage.returncode == 2
    assert "usage:" in usage.stderr


@pytest.mark.root
@pytest.mark.fuse
def test_control_client_through_the_relay(tmp_path: Path) -> None:
    """The control protocol over a relay, as the exec transport carries it: a real
    `sandbox mount` server answers a ControlClient whose socket is joined to the relay's
    stdin and stdout (socat's part played by a socketpair)."""
    with _mounted(tmp_path) as control:
        ours, theirs = socket.socketpair()
        relay = subprocess.Popen([sys.executable, "-m", "sandbox.relay", str(control)],
                                 stdin=theirs.fileno(), stdout=theirs.fileno(), cwd=REPO)
        theirs.close()
        listener_dir = tmp_path / "l"
        listener_dir.mkdir()
        local = listener_dir / "s"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(local))
        server.listen(1)
        accepted: list[socket.socket] = []

        def join() -> None:  # the one accepted connection <-> the relay's end
            conn, _ = server.accept()
            accepted.append(conn)
            for a, b in ((conn, ours), (ours, conn)):
                threading.Thread(target=_copy, args=(a, b), daemon=True).start()

        joiner = threading.Thread(target=join, daemon=True)
        joiner.start()
        with ControlClient(local, timeout=30) as client:
            devices = client.devices()
            reply = client.health("gpu1", "unhealthy", "aer-fatal")
        assert len([d for d in devices if d.startswith("gpu")]) == 8
        assert reply["state"]["health"] == "unhealthy"
        assert relay.wait(30) == 0
        joiner.join(5)
        for sock in (*accepted, ours, server):
            sock.close()


@contextlib.contextmanager
def _mounted(tmp_path: Path) -> Iterator[Path]:
    """`sandbox mount --daemon` of 8gpu-2numa's worker; its control socket."""
    require_fuse()
    root = tmp_path / "root"
    proc = subprocess.run([sys.executable, "-m", "sandbox", "mount", "8gpu-2numa", "--node",
                           "gpu-worker", str(root), "--daemon", "--state-dir", str(tmp_path),
                           "--pid-file", str(tmp_path / "pid")], cwd=REPO, text=True,
                          capture_output=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    try:
        yield tmp_path / "control.sock"
    finally:
        os.kill(int((tmp_path / "pid").read_text()), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while root.is_mount() and time.monotonic() < deadline:
            time.sleep(0.05)
        if root.is_mount():
            unmount(root)
            raise AssertionError("the mount server did not unmount within 30 s of SIGTERM")


def _copy(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(65536):
            dst.sendall(chunk)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


class _Docker:
    """Docker's client as ``choose`` uses it: only ``info()``."""

    def __init__(self, system: str) -> None:
        self.system = system

    def info(self) -> dict[str, Any]:
        return {"OperatingSystem": self.system}


def test_choose_and_force(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(transport.TRANSPORT_ENV, raising=False)
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    assert transport.choose(_Docker("Debian GNU/Linux 12 (bookworm)"))[0] == "host"
    chosen, why = transport.choose(_Docker("Docker Desktop"))
    assert (chosen, why) == ("exec", "Docker Desktop runs its daemon in a VM")
    monkeypatch.setenv("DOCKER_HOST", "ssh://builder@example.org")
    assert transport.choose(_Docker("Ubuntu 24.04"))[0] == "exec"
    monkeypatch.setenv("DOCKER_HOST", "unix:///run/user/1000/docker.sock")
    assert transport.choose(_Docker("Ubuntu 24.04"))[0] == "host"
    # the caller's `docker info` (up asks it once), not the daemon again
    assert transport.choose(_Docker("Ubuntu 24.04"),
                            {"OperatingSystem": "Docker Desktop"})[0] == "exec"
    monkeypatch.setenv(transport.TRANSPORT_ENV, "exec")
    assert transport.choose(_Docker("Ubuntu 24.04")) == ("exec", "SANDBOX_TRANSPORT=exec")
    assert transport.transport_for("host") == "exec"
    monkeypatch.setenv(transport.TRANSPORT_ENV, "auto")
    assert transport.transport_for("exec") == "exec"
    assert transport.transport_for(None) == "host"  # a record from before the choice
    monkeypatch.setenv(transport.TRANSPORT_ENV, "ssh")
    with pytest.raises(SandboxError, match="SANDBOX_TRANSPORT='ssh': expected auto, host"):
        transport.transport_for("host")


def test_paths_in_the_agent_pod(tmp_path: Path) -> None:
    node = tmp_path / "nodes" / "gpu-worker"
    assert transport.in_agent(node, node / "control.sock") == "/var/lib/hw-sandbox/control.sock"
    assert transport.in_agent(node, node / "pod-resources" / "kubelet.sock") == \
        "/var/lib/kubelet/pod-resources/kubelet.sock"
    with pytest.raises(SandboxError, match="not under the node's state dir"):
        transport.in_agent(node, tmp_path / "elsewhere.sock")


def test_the_relay_needs_only_the_standard_library() -> None:
    """It starts in the agent pod for every relayed connection: no import of ours or of a
    third-party package (checked in a fresh interpreter)."""
    code = ("import sys, sandbox.relay; "
            "mods = [m for m in sys.modules if m.startswith('sandbox') "
            "and m not in ('sandbox', 'sandbox.relay')]; print(mods)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[]"
