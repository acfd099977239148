"""A hand-made toy node for FUSE and control tests, independent of the profile builder.

``make_rebuild(n)`` returns a pure ``rebuild(states) -> Tree`` with ``n`` GPUs (PCI dir,
``class/drm`` link, ``/dev/dri`` node, ``aer_dev_fatal`` that counts when unhealthy,
SR-IOV VFs) and one NIC (``operstate`` down on link-down). Unplugged devices are absent.
``python -m fakehw_serve ROOT --rebuild fakehw_toy:rebuild`` serves it (with this
directory on PYTHONPATH). Also holds the "FUSE must be installed" check and a harness that
runs the server as a subprocess.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandbox.fakehw.tree import DeviceRecord, DeviceState, Health, Reason, Tree

TOTAL_VFS = 4
EXTRA_FILES = int(os.environ.get("FAKEHW_TOY_EXTRA_FILES", "0"))


def _aer(count: int) -> str:
    names = ("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt")
    lines = [f"{n} {count if n == 'TLP' else 0}" for n in names]
    return "\n".join([*lines, f"TOTAL_ERR_FATAL {count}"]) + "\n"


def make_rebuild(
    gpus: int = 3, extra_files: int = 0
) -> Callable[[Mapping[str, DeviceState]], Tree]:
    """A rebuild function for a node with ``gpus`` GPUs and one NIC."""

    def rebuild(states: Mapping[str, DeviceState]) -> Tree:
        tree = Tree()
        tree.add_file("proc/cpuinfo", "processor\t: 0\nvendor_id\t: GenuineIntel\n")
        tree.mkdir("sys/class/drm")
        tree.mkdir("sys/bus/pci/devices")
        tree.mkdir("dev/dri")
        tree.add_chardev("dev/null", 1, 3)
        for i in range(gpus):
            did = f"gpu{i}"
            st = states.get(did, DeviceState())
            bdf = f"0000:{0x10 + i:02x}:00.0"
            tree.devices[did] = DeviceRecord(
                did, "gpu", "intel", "toy", bdf, i % 2, (f"dev/dri/card{i}",), st
            )
            if not st.plugged:
                continue
            pdir = f"sys/devices/pci0000:00/{bdf}"
            tree.add_file(f"{pdir}/vendor", "0x8086\n")
            tree.add_file(f"{pdir}/device", f"0x{0x56A0 + i:04x}\n")
            tree.add_file(f"{pdir}/numa_node", f"{i % 2}\n")
            fatal = 1 if st.health is Health.UNHEALTHY and st.reason is Reason.AER_FATAL else 0
            tree.add_file(f"{pdir}/aer_dev_fatal", _aer(fatal))
            tree.add_file(f"{pdir}/config", bytes([0x86, 0x80, 0xA0 + i, 0x56]) + bytes(60))
            tree.add_file(f"{pdir}/sriov_totalvfs", f"{TOTAL_VFS}\n")
            nvfs = st.num_vfs or 0
            if nvfs > TOTAL_VFS:
                raise ValueError(f"num_vfs {nvfs} exceeds sriov_totalvfs {TOTAL_VFS}")
            tree.add_file(f"{pdir}/sriov_numvfs", f"{nvfs}\n")
            for v in range(nvfs):
                vbdf = f"0000:{0x10 + i:02x}:00.{v + 1}"
                tree.add_link(f"{pdir}/virtfn{v}", f"../{vbdf}")
                tree.add_file(f"sys/devices/pci0000:00/{vbdf}/vendor", "0x8086\n")
                tree.add_link(f"sys/devices/pci0000:00/{vbdf}/physfn", f"../{bdf}")
                tree.add_link(f"sys/bus/pci/devices/{vbdf}", f"../../../devices/pci0000:00/{vbdf}")
            for x in range(extra_files):
                tree.add_file(f"{pdir}/extra/attr{x:04d}", f"{did} {x}\n")
            tree.add_file(f"{pdir}/drm/card{i}/dev", f"226:{i}\n")
            tree.add_link(f"sys/class/drm/card{i}", f"../../devices/pci0000:00/{bdf}/drm/card{i}")
            tree.add_link(f"sys/bus/pci/devices/{bdf}", f"../../../devices/pci0000:00/{bdf}")
            tree.add_link(f"sys/dev/char/226:{i}", f"../../devices/pci0000:00/{bdf}/drm/card{i}")
            tree.add_chardev(f"dev/dri/card{i}", 226, i)
        nic = states.get("nic0", DeviceState())
        tree.devices["nic0"] = DeviceRecord(
            "nic0", "nic", "mellanox", "toy", "0000:30:00.0", 0, (), nic
        )
        if nic.plugged:
            ndir = "sys/devices/pci0000:00/0000:30:00.0"
            down = nic.health is Health.UNHEALTHY and nic.reason is Reason.LINK_DOWN
            tree.add_file(f"{ndir}/vendor", "0x15b3\n")
            tree.add_file(f"{ndir}/net/eth0/operstate", "down\n" if down else "up\n")
            tree.add_file(f"{ndir}/net/eth0/carrier", "0\n" if down else "1\n")
            tree.add_link("sys/class/net/eth0", "../../devices/pci0000:00/0000:30:00.0/net/eth0")
            tree.add_link(
                "sys/bus/pci/devices/0000:30:00.0", "../../../devices/pci0000:00/0000:30:00.0"
            )
        return tree

    return rebuild


rebuild = make_rebuild(3, EXTRA_FILES)
rebuild_large = make_rebuild(32, 40)


def require_fuse() -> None:
    """Fail (never skip) with an install hint when FUSE is not usable here."""
    problems = []
    if not os.path.exists("/dev/fuse"):
        problems.append(
            "/dev/fuse is missing (load the fuse module or run with --device /dev/fuse)"
        )
    if shutil.which("fusermount3") is None:
        problems.append("fusermount3 is missing (apt-get install fuse3)")
    if problems:
        pytest.fail("FUSE tests need a working FUSE: " + "; ".join(problems), pytrace=False)


SUPPORT = Path(__file__).resolve().parent  # fakehw_serve and this module, for the server


@dataclass
class Server:
    """A ``python -m fakehw_serve`` subprocess (tests/support/fakehw_serve.py): a toy tree."""

    root: Path
    socket: Path
    proc: subprocess.Popen[bytes]

    @property
    def state_file(self) -> Path:
        return self.root.parent / f"{self.root.name}.state.json"

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def unmount(self, timeout: float = 20.0) -> int:
        """``fusermount3 -u`` (retrying while busy) and the server's exit status."""
        deadline = time.monotonic() + timeout
        while True:
            res = subprocess.run(
                ["fusermount3", "-u", str(self.root)], capture_output=True, text=True
            )
            if res.returncode == 0 or self.proc.poll() is not None:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"fusermount3 -u {self.root}: {res.stderr}")
            time.sleep(0.1)
        rc = self.proc.wait(timeout=timeout)
        self._close_pipe()
        return rc

    def _close_pipe(self) -> None:
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()

    def cleanup(self) -> None:
        """Finalizer: never leave a mount or a process behind, whatever the test did."""
        if self.proc.poll() is None:
            try:
                self.unmount(timeout=10)
            except (AssertionError, subprocess.TimeoutExpired):
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
        self._close_pipe()
        if _is_mountpoint(self.root):
            subprocess.run(["fusermount3", "-uz", str(self.root)], capture_output=True)


def _is_mountpoint(root: Path) -> bool:
    target = str(root)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


@contextlib.contextmanager
def serving(root: Path, *args: str, **kw: Any) -> Iterator[Server]:
    """``start_server`` for the length of a ``with``: at its end the server must still be
    running and unmount cleanly; its process and mount are cleaned up either way."""
    srv = start_server(root, *args, **kw)
    try:
        yield srv
        assert srv.proc.poll() is None, "the server died"
        assert srv.unmount() == 0
    finally:
        srv.cleanup()


def start_server(
    root: Path, *args: str, rebuild: str = "fakehw_toy:rebuild", timeout: float = 20.0,
    wrapper: Sequence[str] = (), env: Mapping[str, str] | None = None,
) -> Server:
    """Start a server on ``root`` and wait until it says it is mounted and listening.
    ``wrapper`` prefixes the command (e.g. ``prlimit --nofile=1024``); ``env`` adds to
    this process's environment."""
    require_fuse()
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT), env.get("PYTHONPATH", "")) if p)
    argv: Sequence[str] = [
        *wrapper,
        sys.executable,
        "-m",
        "fakehw_serve",
        str(root),
        "--rebuild",
        rebuild,
        *args,
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not lines or not lines[0].startswith(b"ready "):
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        raise AssertionError(f"server on {root} did not start (exit {proc.returncode})")
    sock = Path(lines[0].split(b" ", 1)[1].strip().decode())
    return Server(root, sock, proc)


def stat_errno(path: Path) -> int:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno or 0
    return 0


__all__ = ["Server", "errno", "make_rebuild", "rebuild", "require_fuse", "start_server"]
