"""The fast-mode server fills the kernel's caches itself (sandbox/fakehw/serve/kcache.py).

Right after mounting it lists the tree through the mount and pushes every file's bytes
into the page cache, within ``HWSANDBOX_FUSE_WARM_MIB``; after a change it puts the new
bytes of files that kept their length back. What is in the page cache is read with
util-linux's ``fincore`` (mincore/cachestat: it never reads a file, so it cannot fill
the cache itself). The mount must equal a fresh render throughout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from sandbox.fakehw.control import ControlClient
from sandbox.fakehw.serve.fs import FAST_MODE_AVAILABLE
from sandbox.fakehw.tree import DeviceState, File, Health, Reason
from tests.serve.test_fs_live import GPU0, snapshot_mount, snapshot_tree
from tests.support.fakehw_toy import Server, rebuild, start_server

pytestmark = [pytest.mark.root, pytest.mark.fuse]


@pytest.fixture(autouse=True)
def _needs_fast_mode_and_fincore() -> None:
    if not FAST_MODE_AVAILABLE:
        pytest.fail("warming needs the fast mode: pyfuse3 built with scripts/build-pyfuse3 "
                    "(scripts/install and tox build it)", pytrace=False)  # fmt: skip
    if shutil.which("fincore") is None:
        pytest.fail("needs fincore: apt-get install util-linux", pytrace=False)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    servers: list[Server] = []

    def start(**env: str) -> Server:
        srv = start_server(tmp_path / f"root{len(servers)}", env=env)
        servers.append(srv)
        return srv

    try:
        yield start
        for srv in servers:
            assert srv.proc.poll() is None, "the server died"
            assert srv.unmount() == 0
    finally:
        for srv in servers:
            srv.cleanup()


def warm_report(srv: Server) -> dict[str, Any]:
    with ControlClient(srv.socket) as c:
        deadline = time.monotonic() + 20
        while not (warm := c.get()["warm"])["done"]:
            assert time.monotonic() < deadline, f"never done warming: {warm}"
            time.sleep(0.05)
    return dict(warm)


def resident(root: Path, paths: list[str]) -> dict[str, int]:
    """Page-cache pages held for each file (util-linux fincore)."""
    out = subprocess.run(["fincore", "--json", "--bytes", "--output", "PAGES,FILE",
                          *(str(root / p) for p in paths)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    prefix = f"{root}/"
    return {r["file"].removeprefix(prefix): int(r["pages"]) for r in json.loads(out)["fincore"]}


def files_with_data(states: dict[str, DeviceState] | None = None) -> dict[str, bytes]:
    return {p: e.data for p, e in rebuild(states or {}).walk() if isinstance(e, File) and e.data}


def test_fresh_mount_has_every_file_in_the_page_cache(serve: Any) -> None:
    srv = serve()
    warm = warm_report(srv)
    files = files_with_data()
    entries = sum(1 for _ in rebuild({}).walk())
    assert (warm["entries"], warm["files"]) == (entries, len(files))
    assert 0 < warm["kib"] <= 64 * 1024
    pages = resident(srv.root, sorted(files))
    assert {p for p, n in pages.items() if n == 0} == set()
    assert snapshot_mount(srv.root) == snapshot_tree(rebuild({}))


def test_warming_stays_within_its_bound_and_can_be_turned_off(serve: Any) -> None:
    files = sorted(files_with_data())
    small = serve(HWSANDBOX_FUSE_WARM_MIB=str(64 / 1024))  # 64 KiB: one GPU of three
    warm = warm_report(small)
    assert 0 < warm["kib"] <= 64
    assert 0 < sum(1 for n in resident(small.root, files).values() if n) == warm["files"]
    assert warm["files"] < len(files)
    off = serve(HWSANDBOX_FUSE_WARM_MIB="0")
    assert warm_report(off) == {"entries": 0, "files": 0, "kib": 0, "seconds": 0.0,
                                "done": True}  # fmt: skip
    assert set(resident(off.root, files).values()) == {0}
    assert snapshot_mount(small.root) == snapshot_tree(rebuild({}))
    assert snapshot_mount(off.root) == snapshot_tree(rebuild({}))


def test_a_change_puts_the_new_bytes_in_the_page_cache(serve: Any) -> None:
    srv = serve()
    warm_report(srv)
    aer = f"{GPU0}/aer_dev_fatal"  # its length is the same either way
    sick = {"gpu0": DeviceState(Health.UNHEALTHY, Reason.AER_FATAL)}
    with ControlClient(srv.socket) as c:
        for states in (sick, {}):
            c.health("gpu0", "unhealthy" if states else "healthy",
                     "aer-fatal" if states else None)  # fmt: skip
            assert resident(srv.root, [aer]) == {aer: 1}
            assert (srv.root / aer).read_bytes() == files_with_data(states)[aer]
            assert snapshot_mount(srv.root) == snapshot_tree(rebuild(states))


def _fuse_fd_flags(pid: int) -> int:
    """The open flags of the process's /dev/fuse descriptor (from /proc/PID/fdinfo)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        if os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/fuse":
            for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
                if line.startswith("flags:"):
                    return int(line.split()[1], 8)
    raise AssertionError(f"process {pid} holds no /dev/fuse")


def test_queued_requests_are_taken_without_waiting(serve: Any) -> None:
    """Fast mode's one worker reads /dev/fuse non-blocking (pyfuse3 patch level 2): it
    takes queued requests one after another and waits only when none is left, yet lets
    the control server in between. Eight cold readers at once get exactly the tree while
    changes are applied and answered."""
    import pyfuse3

    assert pyfuse3.HWSANDBOX_PATCH >= 2, "rebuild pyfuse3 with scripts/build-pyfuse3"
    srv = serve(HWSANDBOX_FUSE_WARM_MIB="0")  # every first read a round trip
    # The server says ready just before its loop starts; a request answered means it runs.
    assert os.listdir(srv.root)
    assert _fuse_fd_flags(srv.proc.pid) & os.O_NONBLOCK
    expected = snapshot_tree(rebuild({}))
    sick = {"gpu0": DeviceState(Health.UNHEALTHY, Reason.AER_FATAL)}
    with ThreadPoolExecutor(8) as pool, ControlClient(srv.socket) as c:
        reads = [pool.submit(snapshot_mount, srv.root) for _ in range(8)]
        c.health("gpu0", "unhealthy", "aer-fatal")  # answered while they read
        c.health("gpu0", "healthy")
        after = snapshot_tree(rebuild(sick))
        for r in reads:  # each entry as it was before or after a change
            got = r.result()
            assert got.keys() == expected.keys()
            assert [p for p, v in got.items() if v not in (expected[p], after[p])] == []
    assert snapshot_mount(srv.root) == expected


def test_unmount_and_kill_while_warming(tmp_path: Path) -> None:
    """The lister holds directories of the mount open in a mount namespace of its own:
    `fusermount3 -u` (no retry) succeeds while it lists, and SIGKILL of the server ends
    it (a thread of the server listing its own mount would keep the dead process, and
    the mount, hanging forever)."""
    for how in ("fusermount3 -u", "kill -9"):
        root = tmp_path / how.split()[0]
        srv = start_server(root, rebuild="fakehw_toy:rebuild_large")
        try:
            with ControlClient(srv.socket) as c:
                assert not c.get()["warm"]["done"]
            if how == "kill -9":
                srv.proc.send_signal(signal.SIGKILL)
                assert srv.proc.wait(timeout=20) == -signal.SIGKILL
                subprocess.run(["fusermount3", "-u", str(root)], check=False)  # dead mount
            else:
                res = subprocess.run(["fusermount3", "-u", str(root)], capture_output=True,
                                     text=True, check=False)  # fmt: skip
                assert res.returncode == 0, res.stderr
                assert srv.proc.wait(timeout=20) == 0
            assert not os.path.ismount(root)
        finally:
            srv.cleanup()
