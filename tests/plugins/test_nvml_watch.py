"""Our NVML following the tree's control socket (``HWSANDBOX_NVML_WATCH``, docs/nvml.md):
its change stream wakes the event poller, so a fault arrives without waiting for the timer;
shutdown wakes the poller out of its wait; an unreachable socket is logged and the timer goes
on; and random call sequences against a socket that misbehaves in every way never crash.
"""

from __future__ import annotations

import ctypes
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.plugins.test_nvml import init, rendered
from tests.support import nvml_ctypes as N
from tests.support.nvidia import nvml_library
from tests.support.paths import REPO
from tests.support.thirdparty import live_node

pytestmark = [pytest.mark.root, pytest.mark.fuse]


def test_the_control_sockets_change_stream_wakes_the_poller(
    nvml: N.Nvml, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """HWSANDBOX_NVML_WATCH: with the timer at a minute, a fault still reaches
    nvmlEventSetWait, so it came from the control socket's change stream; nvmlShutdown
    wakes the poller out of its wait; a socket that cannot be reached is logged and the
    timer goes on alone."""
    with live_node("8gpu-2numa.yaml", "gpu-worker") as live:
        log = tmp_path / "nvml.log"
        monkeypatch.setenv("HWSANDBOX_NVML_REFRESH_MS", "60000")
        monkeypatch.setenv("HWSANDBOX_NVML_WATCH", str(live.control))
        init(nvml, live.root, monkeypatch)
        with live.client() as client:
            devices = client.devices()
        index = {nvml.pci(nvml.handle(i)).busId.decode()[4:].lower(): i for i in range(8)}
        h3 = nvml.handle(index[devices["gpu3"]["pci_address"]])
        evset = ctypes.c_void_p()
        nvml.check(nvml.nvmlEventSetCreate(ctypes.byref(evset)))
        nvml.check(nvml.nvmlDeviceRegisterEvents(h3, ctypes.c_ulonglong(N.EVENT_XID), evset))
        ev = N.EventData()
        for reason, xid in (("aer-fatal", 48), ("link-down", 79)):
            with live.client() as client:
                client.health("gpu3", "healthy")
                client.health("gpu3", "unhealthy", reason)
            # 20 s: far less than the minute the timer would take
            nvml.check(nvml.nvmlEventSetWait_v2(evset, ctypes.byref(ev), 20_000))
            assert (ev.device, ev.eventData) == (h3.value, xid)
        nvml.check(nvml.nvmlEventSetFree(evset))
        t0 = time.monotonic()
        nvml.check(nvml.nvmlShutdown())  # joins the poller, which waits on the socket
        assert time.monotonic() - t0 < 30, "nvmlShutdown waited out the poller's minute"

        # no socket there (a process of its own: the log is opened once per process):
        # logged, and the fault already present is delivered all the same
        probe = (
            "import ctypes, sys\n"
            "from tests.support import nvml_ctypes as N\n"
            "nv = N.Nvml(sys.argv[1]); nv.check(nv.nvmlInit_v2())\n"
            "s = ctypes.c_void_p(); nv.check(nv.nvmlEventSetCreate(ctypes.byref(s)))\n"
            "nv.check(nv.nvmlDeviceRegisterEvents(nv.handle(int(sys.argv[2])), 8, s))\n"
            "ev = N.EventData(); nv.check(nv.nvmlEventSetWait_v2(s, ctypes.byref(ev), 10000))\n"
            "print(ev.eventData); nv.check(nv.nvmlShutdown())\n"
        )
        env = {**os.environ, "HWSANDBOX_NVML_ROOT": str(live.root), "HWSANDBOX_NVML_LOG": str(log),
               "HWSANDBOX_NVML_REFRESH_MS": "10", "HWSANDBOX_NVML_WATCH": str(tmp_path / "no.sock")}
        out = subprocess.run([sys.executable, "-c", probe, str(nvml_library()),
                              str(index[devices["gpu3"]["pci_address"]])], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert (out.returncode, out.stdout) == (0, "79\n"), out.stderr
        assert f"watch: {tmp_path / 'no.sock'}: No such file or directory; polling instead" \
            in log.read_text()  # fmt: skip


class HostileWatch:
    """A control socket that answers ``watch`` every way a broken or hostile one could: the
    ok line then change lines, garbage, a line with no end, an error line, a close at once,
    silence longer than the library waits, a close in the middle of the stream."""

    def __init__(self, path: Path, seed: int) -> None:
        self.rng = random.Random(seed)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(64)
        self.server.settimeout(0.1)
        self.stopping = threading.Event()
        self.connections = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            self.connections += 1
            seed = self.rng.random()
            threading.Thread(target=self._serve, args=(conn, seed), daemon=True).start()

    def _serve(self, conn: socket.socket, seed: float) -> None:
        rng = random.Random(seed)
        change = (b'{"v":1,"event":"change","seq":1,"time":1.0,"op":"health","device":"gpu3",'
                  b'"state":{"health":"unhealthy","reason":"aer-fatal","plugged":true}}\n')
        with conn:
            try:
                conn.settimeout(5)
                conn.recv(256)
                kind = rng.random()
                if kind < 0.1:
                    return  # closed at once
                if kind < 0.2:
                    conn.sendall(b'{"v":1,"ok":false,"error":"no"}\n')
                    return
                if kind < 0.25:
                    self.stopping.wait(3)  # silence, past the library's 2 s
                    return
                conn.sendall(b'{"v":1,"ok":true,"op":"watch"}\n')
                for _ in range(rng.randint(0, 40)):
                    noise = rng.randbytes(rng.randint(1, 9000))
                    conn.sendall(rng.choice((change, change * 50, noise, b"x" * 70000, b"\n\n")))
                    if self.stopping.wait(rng.random() * 0.005):
                        return
                if rng.random() < 0.5:
                    self.stopping.wait(1)  # then held open a while
            except OSError:
                pass  # the library went away first

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.server.close()


def test_random_call_sequences_with_a_hostile_watch_socket_never_crash(tmp_path: Path) -> None:
    """The fuzz above with HWSANDBOX_NVML_WATCH naming a socket that misbehaves in every way
    (HostileWatch): event sets come and go, pollers start and stop, never a crash."""
    lib = nvml_library()
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    watch = HostileWatch(tmp_path / "watch.sock", seed=3)
    try:
        env = {**os.environ, "HWSANDBOX_NVML_ROOT": str(root), "HWSANDBOX_NVML_REFRESH_MS": "0",
               "HWSANDBOX_NVML_WATCH": str(tmp_path / "watch.sock")}  # fmt: skip
        env.pop("HWSANDBOX_NVML_LOG", None)
        result = subprocess.run(
            [sys.executable, "-m", "tests.support.nvml_ctypes", "fuzz", str(lib), str(root),
             "3000", "3"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
    finally:
        watch.close()
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-3000:]}"
    codes = dict(item.split(":") for item in result.stdout.split())
    assert int(codes.get("0", 0)) > 500, codes
    print(f"{watch.connections} watch connections")
    assert watch.connections > 10, "the pollers never connected: nothing was fuzzed"
