"""The live FUSE tree: real mounts served by a subprocess, checked through the kernel.

Every test mounts ``fakehw_toy`` (a hand-made tree) with ``python -m fakehw_serve``
(tests/support/fakehw_serve.py, over ``sandbox.fakehw.serve.fs.serve``) and unmounts with
``fusermount3 -u``, asserting the server exits 0. Missing FUSE fails with an install hint.
The pure diff/state logic of ``sandbox.fakehw.serve.live`` is tested here too, without a mount.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.errors import ControlError, MountError
from sandbox.fakehw.changes import Change, next_state
from sandbox.fakehw.control import ControlClient
from sandbox.fakehw.control.scenario import storm
from sandbox.fakehw.serve.live import LiveTree
from sandbox.fakehw.serve.mountroot import check_mount_root, mounted_fstype, recover_mount
from sandbox.fakehw.serve.treediff import diff_index
from sandbox.fakehw.states import load_states, save_states
from sandbox.fakehw.tree import (
    BlockDevice,
    CharDevice,
    DeviceState,
    Dir,
    File,
    Health,
    Reason,
    Symlink,
    Tree,
)
from sandbox.profile.catalogue import fault_reasons
from tests.support.fakehw_toy import Server, make_rebuild, rebuild, require_fuse, start_server

pytestmark = [pytest.mark.root, pytest.mark.fuse]

GPU0 = "sys/devices/pci0000:00/0000:10:00.0"
GPU1 = "sys/devices/pci0000:00/0000:11:00.0"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = start_server(tmp_path / "root")
    try:
        yield srv
        if srv.proc.poll() is None:
            assert srv.unmount() == 0, "server did not exit cleanly after fusermount3 -u"
    finally:
        srv.cleanup()


def snapshot_mount(root: Path) -> dict[str, tuple[str, object]]:
    """Everything under a mounted root as path -> (kind, content), read through the kernel."""
    out: dict[str, tuple[str, object]] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        for name in os.listdir(root / rel):
            path = f"{rel}/{name}" if rel else name
            full = root / path
            st = os.lstat(full)
            if stat.S_ISDIR(st.st_mode):
                out[path] = ("dir", stat.S_IMODE(st.st_mode))
                stack.append(path)
            elif stat.S_ISLNK(st.st_mode):
                out[path] = ("link", os.readlink(full))
            elif stat.S_ISCHR(st.st_mode):
                out[path] = ("chr", (os.major(st.st_rdev), os.minor(st.st_rdev)))
            elif stat.S_ISBLK(st.st_mode):
                out[path] = ("blk", (os.major(st.st_rdev), os.minor(st.st_rdev)))
            else:
                data = full.read_bytes()
                assert st.st_size == len(data), path
                out[path] = ("file", (stat.S_IMODE(st.st_mode), data))
    return out


def snapshot_tree(tree: Tree) -> dict[str, tuple[str, object]]:
    out: dict[str, tuple[str, object]] = {}
    for path, e in tree.walk():
        if isinstance(e, Dir):
            out[path] = ("dir", e.mode)
        elif isinstance(e, Symlink):
            out[path] = ("link", e.target)
        elif isinstance(e, CharDevice):
            out[path] = ("chr", (e.major, e.minor))
        elif isinstance(e, BlockDevice):
            out[path] = ("blk", (e.major, e.minor))
        else:
            assert isinstance(e, File)
            out[path] = ("file", (e.mode, e.data))
    return out


# -- pure logic -------------------------------------------------------------------------
def test_diff_names_exactly_what_changed() -> None:
    before = LiveTree(rebuild)
    old = before.snapshot.index
    diff = before.apply(Change("health", "gpu0", health=Health.UNHEALTHY, reason=Reason.AER_FATAL))
    assert diff.changed == ((f"{GPU0}/aer_dev_fatal", "file"),)
    assert not diff.removed
    assert not diff.added
    assert not diff.dirs
    diff = before.apply(Change("unplug", "gpu1"))
    removed = {p for p, _ in diff.removed}
    assert {GPU1, "sys/class/drm/card1", "dev/dri/card1", f"{GPU1}/vendor"} <= removed
    assert {"sys/class/drm", "dev/dri", "sys/devices/pci0000:00"} <= set(diff.dirs)
    assert GPU1 not in diff.dirs  # a vanished directory needs no listing refresh
    assert diff_index(old, old).__bool__() is False


def test_diff_reports_kind_change_as_remove_and_add() -> None:
    a, b = Tree(), Tree()
    a.add_file("x", "1\n")
    b.add_link("x", "y")
    d = diff_index(LiveTree(lambda s: a).snapshot.index, LiveTree(lambda s: b).snapshot.index)
    assert d.removed == (("x", "file"),)
    assert d.added == (("x", "link"),)


def test_state_transitions() -> None:
    s = DeviceState()
    gone = next_state(s, Change("health", "d", health=Health.UNHEALTHY, reason=Reason.REMOVED))
    assert not gone.plugged
    assert gone.reason is Reason.REMOVED
    back = next_state(gone, Change("plug", "d"))
    assert back == DeviceState()
    assert next_state(s, Change("set-vfs", "d", num_vfs=3)).num_vfs == 3
    with pytest.raises(ControlError, match="needs a reason"):
        Change("health", "d", health=Health.UNHEALTHY)


def test_live_tree_knows_unplugged_devices_and_rejects_unknown() -> None:
    live = LiveTree(rebuild, {"gpu2": DeviceState(plugged=False)})
    assert [d.id for d in live.device_list()] == ["gpu0", "gpu1", "gpu2", "nic0"]
    assert live.snapshot.index.get("dev/dri/card2") is None
    with pytest.raises(ControlError, match="unknown device 'gpu9'"):
        live.apply(Change("plug", "gpu9"))
    with pytest.raises(ControlError, match="exceeds sriov_totalvfs"):
        live.apply(Change("set-vfs", "gpu0", num_vfs=99))


def test_state_file_round_trip(tmp_path: Path) -> None:
    states = {
        "gpu0": DeviceState(Health.UNHEALTHY, Reason.AER_FATAL, True, 2),
        "nic0": DeviceState(plugged=False),
    }
    save_states(tmp_path / "s.json", states)
    assert load_states(tmp_path / "s.json") == states
    assert load_states(tmp_path / "missing.json") == {}
    (tmp_path / "bad.json").write_text('{"v": 1, "devices": {"gpu0": {"health": "meh"}}}')
    with pytest.raises(ControlError, match="devices.gpu0"):
        load_states(tmp_path / "bad.json")


@pytest.mark.parametrize("path", ["/sys/fake", "/dev/x", "/proc", "/", "/sys"])
def test_refuses_real_sys_dev_proc(path: str) -> None:
    with pytest.raises(MountError, match="refusing"):
        check_mount_root(path)


def test_recover_mount_on_plain_dir_is_a_no_op(tmp_path: Path) -> None:
    assert recover_mount(check_mount_root(tmp_path)) is False
    assert recover_mount(check_mount_root(tmp_path / "missing")) is False


# -- real mounts ------------------------------------------------------------------------
def test_serves_identical_bytes_links_and_nodes(server: Server) -> None:
    assert snapshot_mount(server.root) == snapshot_tree(rebuild({}))
    assert mounted_fstype(server.root) == "fuse"
    with open("/proc/self/mountinfo") as f:
        line = next(x for x in f if x.split()[4] == str(server.root))
    assert " hwsandbox " in line
    for opt in ("ro", "nodev", "allow_other", "default_permissions"):
        assert opt in ",".join(line.split()).split(","), (opt, line)
    st = os.stat(server.root / "dev/dri/card1")
    assert stat.S_ISCHR(st.st_mode)
    assert st.st_rdev == os.makedev(226, 1)
    assert os.statvfs(server.root).f_namemax == 255
    with pytest.raises(OSError, match="Read-only|Permission") as exc:
        open(server.root / GPU0 / "vendor", "w")  # noqa: SIM115
    assert exc.value.errno in (errno.EROFS, errno.EACCES)
    ino = os.stat(server.root / GPU0 / "vendor").st_ino
    assert os.stat(server.root / GPU0 / "vendor").st_ino == ino


def test_dev_map_reports_every_node_as_dev_null(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    srv = start_server(tmp_path / "root", "--dev-map")
    request.addfinalizer(srv.cleanup)
    for node in ("dev/dri/card0", "dev/dri/card2", "dev/null"):
        assert os.stat(srv.root / node).st_rdev == os.makedev(1, 3)
    assert srv.unmount() == 0


def test_unplug_removes_entries_and_plug_restores_them(server: Server) -> None:
    root = server.root
    before = snapshot_mount(root)  # warms every kernel cache
    ino = os.stat(root / GPU1 / "vendor").st_ino
    with ControlClient(server.socket) as c:
        t0 = time.monotonic()
        c.unplug("gpu1")
        assert "card1" not in os.listdir(root / "sys/class/drm")
        assert "card1" not in os.listdir(root / "dev/dri")
        assert "0000:11:00.0" not in os.listdir(root / "sys/bus/pci/devices")
        assert not (root / GPU1).exists()
        assert not os.path.lexists(root / "sys/dev/char/226:1")
        assert time.monotonic() - t0 < 1.0
        c.plug("gpu1")
    assert snapshot_mount(root) == before
    assert os.stat(root / GPU1 / "vendor").st_ino == ino  # stable per path


def test_health_flip_is_visible_on_next_open(server: Server) -> None:
    aer = server.root / GPU0 / "aer_dev_fatal"
    oper = server.root / "sys/class/net/eth0/operstate"
    assert aer.read_text().endswith("TOTAL_ERR_FATAL 0\n")
    assert oper.read_text() == "up\n"
    with ControlClient(server.socket) as c:
        for _ in range(20):  # every flip, with the old value in the page cache
            c.health("gpu0", "unhealthy", "aer-fatal")
            assert aer.read_text().endswith("TOTAL_ERR_FATAL 1\n")
            assert os.stat(aer).st_size == len(aer.read_bytes())
            c.health("gpu0", "healthy")
            assert aer.read_text().endswith("TOTAL_ERR_FATAL 0\n")
        c.health("nic0", "unhealthy", "link-down")
        assert oper.read_text() == "down\n"
        assert (server.root / "sys/class/net/eth0/carrier").read_text() == "0\n"
        c.set_vfs("gpu0", 2)
        assert os.readlink(server.root / GPU0 / "virtfn1") == "../0000:10:00.2"
        assert (server.root / GPU0 / "sriov_numvfs").read_text() == "2\n"


def test_open_file_of_unplugged_device_fails_then_recovers(server: Server) -> None:
    with open(server.root / GPU0 / "numa_node", "rb", buffering=0) as f:
        with ControlClient(server.socket) as c:
            c.unplug("gpu0")
            with pytest.raises(OSError, match="No such") as exc:
                os.pread(f.fileno(), 100, 0)
            # the kernel refreshes attributes first (ENOENT) or asks us to read (ENODEV)
            assert exc.value.errno in (errno.ENOENT, errno.ENODEV)
            c.plug("gpu0")
        assert os.pread(f.fileno(), 100, 0) == b"0\n"


def test_states_survive_a_restart(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    srv = start_server(tmp_path / "root")
    request.addfinalizer(srv.cleanup)
    with ControlClient(srv.socket) as c:
        c.health("gpu0", "unhealthy", "aer-fatal")
        c.unplug("gpu2")
    assert os.stat(srv.state_file).st_mode & 0o777 == 0o600
    assert srv.unmount() == 0
    srv2 = start_server(tmp_path / "root")
    request.addfinalizer(srv2.cleanup)
    assert (srv2.root / GPU0 / "aer_dev_fatal").read_text().endswith("TOTAL_ERR_FATAL 1\n")
    assert not (srv2.root / "dev/dri/card2").exists()
    with ControlClient(srv2.socket) as c:
        assert c.devices()["gpu2"]["state"]["plugged"] is False
    assert srv2.unmount() == 0


def test_kill_9_leaves_dead_mount_that_next_server_recovers(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    srv = start_server(tmp_path / "root")
    request.addfinalizer(srv.cleanup)
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait()
    with pytest.raises(OSError, match="not connected") as exc:
        os.stat(srv.root)
    assert exc.value.errno == errno.ENOTCONN
    srv2 = start_server(tmp_path / "root")  # recovers the dead mount, reuses the socket path
    request.addfinalizer(srv2.cleanup)
    assert (srv2.root / GPU0 / "vendor").read_text() == "0x8086\n"
    assert srv2.unmount() == 0
    assert mounted_fstype(srv2.root) is None


def test_second_server_on_a_live_mount_is_refused(server: Server) -> None:
    with pytest.raises(AssertionError, match="did not start"):
        start_server(server.root, timeout=10)
    assert (server.root / GPU0 / "vendor").exists()


def test_sigterm_unmounts_and_exits_cleanly(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    srv = start_server(tmp_path / "root")
    request.addfinalizer(srv.cleanup)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=20) == 0
    assert mounted_fstype(srv.root) is None
    assert not srv.socket.exists()


def _read_twice(path: Path) -> tuple[bytes, bytes]:
    """A whole file in one read(), then the read at its end that every reader makes to see
    EOF. A change between the two must not show: the second read returns nothing even if
    the file now holds a longer value (its inode's size never changes, see fakehw.serve.fs)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1 << 16), os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def _readers_storm(server: Server, changes: int, seed: int) -> dict[str, int]:
    """8 threads re-read the whole tree while ``changes`` seeded changes run."""
    devices = ["gpu0", "gpu1", "gpu2", "nic0"]
    records = rebuild({}).devices  # the server refuses a fault a device cannot show
    actions = storm(
        random.Random(seed),
        start=0,
        changes=changes,
        over=0,
        devices=devices,
        ops=("health", "unplug", "plug", "set-vfs"),
        max_vfs=4,
        shows=lambda d, r: r.value in fault_reasons(records[d].kind, records[d].vendor),
    )
    # Every value any path can have in any state the server passes through.
    states: dict[str, DeviceState] = {}
    possible: dict[str, set[object]] = {}
    trees = [rebuild(states)]
    for a in actions:
        assert a.change is not None
        states[a.change.device] = next_state(states.get(a.change.device, DeviceState()), a.change)
        trees.append(rebuild(states))
    for t in trees:
        for path, value in snapshot_tree(t).items():
            possible.setdefault(path, set()).add(value)

    stop = threading.Event()
    bad: list[str] = []
    counts = {"reads": 0, "vanished": 0}
    lock = threading.Lock()

    def reader() -> None:
        root = server.root
        reads = vanished = 0
        while not stop.is_set():
            stack = [""]
            while stack:
                rel = stack.pop()
                try:
                    names = os.listdir(root / rel)
                except (FileNotFoundError, NotADirectoryError):
                    vanished += 1
                    continue
                for name in names:
                    path = f"{rel}/{name}" if rel else name
                    full = root / path
                    try:
                        st = os.lstat(full)
                        if stat.S_ISDIR(st.st_mode):
                            stack.append(path)
                            continue
                        if stat.S_ISLNK(st.st_mode):
                            value: object = ("link", os.readlink(full))
                        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                            kind = "chr" if stat.S_ISCHR(st.st_mode) else "blk"
                            value = (kind, (os.major(st.st_rdev), os.minor(st.st_rdev)))
                        else:
                            data, tail = _read_twice(full)
                            value = ("file", (stat.S_IMODE(st.st_mode), data))
                            if tail:
                                with lock:
                                    bad.append(f"{path}: {data!r}, then {tail!r} at its EOF")
                        reads += 1
                    except OSError as exc:
                        if exc.errno in (errno.ENOENT, errno.ENODEV, errno.ENOTDIR):
                            vanished += 1
                            continue
                        with lock:
                            bad.append(f"{path}: {exc!r}")
                        continue
                    if value not in possible.get(path, ()):
                        with lock:
                            bad.append(f"{path}: {value!r} is no state's value")
        with lock:
            counts["reads"] += reads
            counts["vanished"] += vanished

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        with ControlClient(server.socket) as c:
            from sandbox.fakehw.control.scenario import apply_action

            for a in actions:
                assert a.change is not None
                apply_action(c, a.change)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not bad, f"{len(bad)} bad reads, first: {bad[:5]}"
    assert server.proc.poll() is None, "server crashed"
    # After the storm the mount must show exactly the final state.
    assert snapshot_mount(server.root) == snapshot_tree(trees[-1])
    return counts


def test_stress_readers_during_storm(server: Server) -> None:
    # Warm up with a storm as large as the measured one: caches, the inode table, the
    # thread pool and the allocator's arenas reach their working size first (after a
    # 100-change warm-up, a loaded machine measured 8,200 KiB of growth without a leak).
    _readers_storm(server, 1000, seed=7)
    rss_before = server.rss_kib()
    counts = _readers_storm(server, 1000, seed=1234)
    rss_after = server.rss_kib()
    assert counts["reads"] > 1000
    # Roughly flat: no per-change or per-read growth (1000 changes would show MiBs).
    assert rss_after - rss_before < 8 * 1024, (rss_before, rss_after)


def test_require_fuse_passes_here() -> None:
    require_fuse()  # fails with an install hint where FUSE is missing


def test_big_tree_round_trips(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    srv = start_server(tmp_path / "root", rebuild="fakehw_toy:rebuild_large")
    request.addfinalizer(srv.cleanup)
    assert snapshot_mount(srv.root) == snapshot_tree(make_rebuild(32, 40)({}))
    assert srv.unmount() == 0
