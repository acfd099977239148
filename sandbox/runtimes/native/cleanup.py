"""Removing what a native sandbox left on the host: containers, mounts, network
namespaces, cgroups, sysctls, CNI results, log links and the directories it created."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from sandbox import supervisor
from sandbox.commands import run
from sandbox.errors import CommandError
from sandbox.progress import Progress
from sandbox.runtimes.native.common import BRIDGE, Layout, ctr, running
from sandbox.runtimes.record import SandboxRecord
from sandbox.supervisor import Proc


def mounts_below(*roots: Path) -> list[str]:
    """Mount points at or below any of ``roots``, deepest first."""
    prefixes = [str(r.resolve()) for r in roots]
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == p or point.startswith(p + "/") for p in prefixes):
            found.append(point)
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


def unmount_below(*roots: Path) -> None:
    for _ in range(3):  # stacked mounts need more than one pass
        points = mounts_below(*roots)
        if not points:
            return
        for point in points:
            run(["umount", "-l", point], check=False)


def as_proc(pid: int, name: str, layout: Layout) -> Proc | None:
    """A process we did not start ourselves but own (a shim of our containerd), as a
    ``Proc`` (pid + its start time now) so that it is stopped like ours."""
    start = supervisor.start_time(pid)
    return None if start is None else Proc(name, pid, start, layout.logs / "containerd.log")


def shim_pids(sock: Path) -> list[int]:
    """containerd shims started by OUR containerd (their argv names its socket)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and b"containerd-shim" in argv[0] and str(sock).encode() in argv:
            pids.append(int(entry.name))
    return pids


def cgroup_dirs(name: str) -> Iterator[Path]:
    root = Path("/sys/fs/cgroup")
    if not root.is_dir():
        return
    for hierarchy in root.iterdir():
        d = hierarchy / name
        if d.is_dir():
            yield d


def rmdir_tree(top: Path) -> None:
    for dirpath, _dirnames, _files in sorted(os.walk(top), key=lambda t: -len(t[0])):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)


def sysctl(key: str) -> str | None:
    try:
        return (Path("/proc/sys") / key).read_text().strip()
    except OSError:
        return None


def remove_containers(layout: Layout, progress: Progress) -> list[str]:
    """Kill and delete every k8s.io task and container; return their netns paths."""
    if running(layout, "containerd") is None:
        return []
    ctr_argv = ctr(layout)
    netns: set[str] = set()
    ids = run([*ctr_argv, "containers", "ls", "-q"], check=False).stdout.split()
    if ids:
        progress(f"removing {len(ids)} containers")
    for cid in ids:
        with contextlib.suppress(json.JSONDecodeError, CommandError):
            info = json.loads(run([*ctr_argv, "containers", "info", cid]).stdout)
            for ns in info.get("Spec", {}).get("linux", {}).get("namespaces", []):
                path = ns.get("path", "")
                if ns.get("type") == "network" and "/netns/" in path:
                    netns.add(path)
        run([*ctr_argv, "tasks", "kill", "-s", "SIGKILL", cid], check=False)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        tasks = run([*ctr_argv, "tasks", "ls", "-q"], check=False).stdout.split()
        for cid in tasks:
            run([*ctr_argv, "tasks", "delete", "--force", cid], check=False, timeout=30)
        if not tasks:
            break
        time.sleep(0.3)
    for cid in ids:
        run([*ctr_argv, "containers", "rm", cid], check=False)
    return sorted(netns)


# A file ``up`` puts in a directory it created for this sandbox alone (the kubelet root):
# ``down`` removes such a directory whole, and any other directory it created (shared
# system places such as /var/lib/cni) only as far as it is empty of others' files.
CREATED_MARKER = ".hw-sandbox-created"


def host_cleanup(layout: Layout, record: SandboxRecord, progress: Progress) -> list[str]:
    """Everything but processes: mounts, netns, the bridge, cgroups, sysctls, CNI results,
    log links, created directories. Returns what it could not remove."""
    from sandbox.agent import unmount
    from sandbox.runtimes.native.common import (
        DEVICE_CHECKPOINT,
        DEVICE_PLUGINS_DIR,
        kubelet_root,
    )
    from sandbox.runtimes.native.hostpaths import unlink_host_paths

    state_dir = layout.state
    root = Path(record.kubelet_root or str(kubelet_root()))
    node_root = state_dir / "node-root"
    if os.path.ismount(node_root):
        unmount(node_root)
    progress("unmounting")
    unmount_below(root, state_dir)
    for ns in record.netns or ():
        run(["umount", ns], check=False)
        with contextlib.suppress(OSError):
            os.unlink(ns)
    run(["ip", "link", "del", BRIDGE], check=False)
    for name in ("kubepods", "kubepods.slice"):
        for d in cgroup_dirs(name):
            rmdir_tree(d)
    for key, value in (record.sysctls or {}).items():
        if value is not None and sysctl(key) != value:
            with contextlib.suppress(OSError):
                (Path("/proc/sys") / key).write_text(value + "\n")
    cni_cache = Path("/var/lib/cni/results")
    if cni_cache.is_dir():
        for f in cni_cache.glob("hw-sandbox-*"):
            f.unlink(missing_ok=True)
    logs = Path("/var/log/containers")
    if logs.is_dir():
        for link in logs.iterdir():
            if link.is_symlink() and os.readlink(link).startswith(str(state_dir)):
                link.unlink()
    unlink_host_paths(state_dir)  # /var/lib/hw-sandbox/* that `plugins deploy` linked here
    # the device manager's checkpoint names this cluster's devices: no other kubelet's
    # (and its socket, which it leaves behind; the next kubelet makes its own)
    (DEVICE_PLUGINS_DIR / DEVICE_CHECKPOINT).unlink(missing_ok=True)
    if (DEVICE_PLUGINS_DIR / "kubelet.sock").is_socket():
        (DEVICE_PLUGINS_DIR / "kubelet.sock").unlink(missing_ok=True)
    problems = []
    for created in record.created_paths or ():
        path = Path(created)
        if not path.is_dir() or path.is_symlink():
            continue
        if (path / CREATED_MARKER).is_file():
            problems += remove_own_dir(path)
        elif not mounts_below(path):
            rmdir_tree(path)
    if state_dir.exists() and mounts_below(state_dir):
        problems.append(f"mounts remain below {state_dir}")
    return problems


def remove_own_dir(path: Path, attempts: int = 5, pause: float = 0.5) -> list[str]:
    """Remove a directory ``up`` made for this sandbox alone (the kubelet root), with what
    is mounted below it. A mount or entry that appears meanwhile (a kubelet or shim still
    exiting under load) gets another pass; what is left after ``attempts`` is reported,
    never passed over in silence (the next ``up`` would find a kubelet root not its own)."""
    for attempt in range(attempts):
        if attempt:
            time.sleep(pause)
        unmount_below(path)
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return []
    try:
        path.rmdir()
        return []
    except OSError as exc:
        return [f"{path} (made by up) remains ({exc.strerror}): {left_in(path)}"]


def left_in(path: Path) -> str:
    """What a directory that should be gone still holds: mounts below it, entries."""
    inside = sorted(str(p.relative_to(path)) for p in path.rglob("*"))
    return (f"mounts below it: {mounts_below(path) or 'none'}; {len(inside)} entries "
            f"{inside[:10]}")
