"""The ``local`` runtime: no Kubernetes, no containers; works anywhere FUSE does.

Per node replica, three host processes under ``<state>/nodes/<node>/``:
  mount    ``sandbox mount``: the node's fake /sys, /dev, /proc live at ``root/``,
           control socket ``control.sock`` (what ``sandbox fault`` talks to)
  kubelet  ``sandbox kubelet serve``: the kubelet harness on ``kubelet/kubelet.sock``;
           it writes what a kubelet would advertise to ``kubelet-status.json``
  plugin   our reference device plugin, reading only ``root/sys`` and ``root/dev``;
           started with the harness but held (``sandbox.prestart``) until the tree is
           served, so its start-up overlaps the mount
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path

from sandbox import supervisor
from sandbox.agent.spawn import start_node, unmount, wait_node
from sandbox.errors import RuntimeBackendError, SandboxError
from sandbox.fakehw.states import initial_states
from sandbox.kubelet.status import read_status
from sandbox.profile import spec
from sandbox.profile.spec import Cluster, NodeSpec
from sandbox.progress import Progress
from sandbox.runtimes.base import (
    NodeStatus,
    ResourceStatus,
    SandboxStatus,
    add_devices,
    advertisable,
    refuse_options,
)
from sandbox.runtimes.record import NodeRecord, SandboxRecord, read_record, write_record
from sandbox.runtimes.steps import Step, interrupts_held, run_steps, take_down
from sandbox.supervisor import Proc, log_tail

READY_TIMEOUT = 20.0
_FIRST_SCAN = 10.0  # seconds the plugin gets to advertise before we count without it
PLUGIN_MODULE = "hwplugins.deviceplugin"
PLUGIN_GO = "plugin.go"  # created in a node's dir once its tree is served: the plugin runs
PLUGIN_HOLD = 300.0  # seconds a started plugin waits for PLUGIN_GO before it gives up


def node_dir(state_dir: Path, node: str) -> Path:
    return state_dir / "nodes" / node


class LocalRuntime:
    name = "local"

    def __init__(self, *, reference_plugin: bool = True, plugin_options: Sequence[str] = (),
                 emulate_topology: bool = True, feature_gates: Mapping[str, bool] | None = None,
                 dra_options: Sequence[str] = (), dra_driver: bool | None = None) -> None:
        """The local runtime is our device plugin and the kubelet harness: no option to
        leave the plugin out or change its flags, no Kubernetes to configure. It has no
        kubelet topology either, so ``emulate_topology`` changes nothing."""
        del emulate_topology
        refuse_options(self.name, reference_plugin=not reference_plugin,
                       plugin_options=plugin_options, feature_gates=feature_gates,
                       dra_options=dra_options, dra_driver=dra_driver)

    def unavailable_reason(self) -> str | None:
        if not Path("/dev/fuse").exists():
            return "no /dev/fuse (modprobe fuse, or give the container --device /dev/fuse)"
        if os.geteuid() != 0:
            return "needs root (FUSE mounts with allow_other and root-only control sockets)"
        return None

    def up(self, cluster: Cluster, profile_path: str, state_dir: Path,
           progress: Progress) -> None:
        reason = self.unavailable_reason()
        if reason:
            raise RuntimeBackendError("check", reason)
        record = SandboxRecord(name=state_dir.name, runtime=self.name, profile=profile_path,
                               created_at=time.time())
        write_record(state_dir, record)
        up = _Up(self, cluster, profile_path, state_dir, record, progress)
        run_steps(_steps(state_dir, progress, up), progress)

    def _start_kubelet(self, node: NodeSpec, state_dir: Path) -> Proc:
        d = node_dir(state_dir, node.name)
        (d / "kubelet").mkdir(parents=True, exist_ok=True)
        return supervisor.spawn(
            f"kubelet harness {node.name}",
            [sys.executable, "-m", "sandbox.kubelet", "--dir", str(d / "kubelet"),
             "--status-file", str(d / "kubelet-status.json"),
             "--numa-nodes", str(len(node.numa))],
            d / "kubelet.log")

    def _wait_advertised(self, node: NodeSpec, state_dir: Path, progress: Progress) -> None:
        """Until the plugin has registered and reported every device of the node.

        How many that is, the plugin's own discovery says (``_advertised``), run here once
        the plugin serves a socket beside kubelet.sock or has advertised something: a
        plugin serves only after its first full scan (and before it registers), so this
        one reads warm kernel caches instead of competing with it for the FUSE server (at
        1,000 GPUs one cold scan alone took 1.7 s, two at once 2.5 s each, a warm one 0.1 s
        with one reader), while the plugin registers. Where the spec promises nothing to
        advertise, or nothing is served within ``_FIRST_SCAN`` s, the count is asked at
        once."""
        if not node.devices:
            return
        # The count's imports (~0.15 s) are paid while the plugin starts, not after it.
        threading.Thread(target=_import_discovery, daemon=True).start()
        d = node_dir(state_dir, node.name)
        started = time.monotonic()
        plugged = len(node.devices) - sum(not s.plugged for s in initial_states(node).values())
        expected = None if advertisable(node, plugged) else _advertised(d / "root")
        if expected == 0:
            return
        deadline = started + READY_TIMEOUT
        seen, last, since = 0, -1, time.monotonic()
        while time.monotonic() < deadline:
            seen = sum(r.capacity for r in read_status(d / "kubelet-status.json"))
            if seen != last:
                last, since = seen, time.monotonic()
            if expected is None:
                warm = bool(seen) or _plugin_serving(d / "kubelet")  # the plugin read it
                if warm or time.monotonic() - started > _FIRST_SCAN:
                    expected = _advertised(d / "root", warm)
                    if expected == 0:
                        return
                    continue  # read the status again: the scan took a while
            # Done when every device we expect is there, or (profiles with devices our
            # plugin groups differently) when the count has settled for two scans.
            if expected is not None and (seen >= expected
                                         or (seen and time.monotonic() - since > 2.0)):
                progress(f"{node.name}: kubelet sees {seen} device(s)")
                return
            time.sleep(0.05)
        raise RuntimeBackendError(
            f"plugin {node.name}", f"only {seen} device(s) advertised after {READY_TIMEOUT:.0f}s;"
            f" plugin log: {log_tail(d / 'plugin.log')}")

    def down(self, state_dir: Path, progress: Progress) -> None:
        def leftovers() -> None:
            # Anything mounted below the state dir that the record missed (a crashed up).
            for root in sorted(state_dir.glob("nodes/*/root")):
                with contextlib.suppress(SandboxError):
                    unmount(root)

        take_down(state_dir, _steps(state_dir, progress), progress, leftovers)

    def status(self, state_dir: Path) -> SandboxStatus:
        record = read_record(state_dir) or SandboxRecord()
        out = SandboxStatus(state_dir.name, self.name, record.profile or "?")
        for name, info in record.nodes.items():
            node = NodeStatus(name, ready=True)
            node.ready = add_devices(node, Path(info.socket))
            for res in read_status(Path(info.status_file)) if info.status_file else ():
                node.resources.append(ResourceStatus(res.name, res.capacity, res.allocatable,
                                                     res.by_numa))
            procs = _procs(info)
            for what, proc in procs.items():
                if not proc.running():
                    node.ready = False
                    node.down.append(what)
                    node.notes.append(f"{what} process {proc.pid} is not running "
                                      f"(log {proc.log})")
            if not (procs.get("kubelet") and procs["kubelet"].running()) and node.resources:
                # What it last wrote is history: nothing advertises these now.
                node.notes.append("kubelet harness down: its last advertised resources "
                                  "are not shown")
                node.resources = []
            out.nodes.append(node)
        return out

    def restart_kubelet(self, state_dir: Path, node: str) -> None:
        """SIGHUP the harness (it restarts as a kubelet does) and wait until it has."""
        kubelet = _procs(_node_info(state_dir, node)).get("kubelet")
        if kubelet is not None:
            kubelet = replace(kubelet, log_offset=kubelet.log.stat().st_size
                              if kubelet.log.exists() else 0)
        if kubelet is None or not kubelet.signal(signal.SIGHUP):
            pid = kubelet.pid if kubelet else "?"
            raise SandboxError(f"{node}: the kubelet harness (pid {pid}) is not running; "
                               "`sandbox down` and `sandbox up` again")
        try:
            supervisor.wait_line(kubelet, b"restarted", READY_TIMEOUT)
        except SandboxError as exc:
            raise SandboxError(f"{node}: the kubelet harness did not restart: {exc}") from exc

    def registered_plugins(self, state_dir: Path, node: str) -> frozenset[str]:
        return _registered(_node_info(state_dir, node))

    def pod_resources_socket(self, state_dir: Path, node: str) -> Path | None:
        return None  # the kubelet harness serves no pod-resources API

    def reach(self, state_dir: Path, node: str, socket: Path) -> AbstractContextManager[Path]:
        return nullcontext(socket)  # host processes: their sockets are this host's

    def load_images(self, state_dir: Path, images: Sequence[str], archives: Sequence[Path],
                    progress: Progress) -> None:
        raise SandboxError(
            f"sandbox {state_dir.name!r} runs the local runtime, which runs no containers "
            "(its device plugin and kubelet harness are host processes): there is nothing "
            "to load an image into; bring one up with --runtime kind or --runtime native")


class _Up:
    """One ``up``: the steps' ``do``s. Every node's harness and plugin start first (the
    plugin held until its tree is served: ``sandbox.prestart``), then each tree is
    mounted, then the plugins go: Python start-up dominates, so it overlaps across
    nodes and with the mounts."""

    def __init__(self, runtime: LocalRuntime, cluster: Cluster, profile_path: str,
                 state_dir: Path, record: SandboxRecord, progress: Progress) -> None:
        self.runtime, self.cluster, self.profile_path = runtime, cluster, profile_path
        self.state_dir, self.record, self.progress = state_dir, record, progress
        self.kubelets: dict[str, Proc] = {}

    def _add_proc(self, node: str, what: str, proc: Proc) -> None:
        self.record = self.record.with_node(
            node, self.record.nodes[node].with_proc(what, proc.to_json()))

    @contextlib.contextmanager
    def _starting(self) -> Iterator[list[Proc]]:
        """Processes started in the block (the caller adds each to the list and to the
        record) are on disk in ``sandbox.json`` when it ends, or stopped: a SIGINT waits
        until the record is written (``interrupts_held``), and should the record not be
        written (the state root is full) they are stopped at once. The clean-up stops
        what the record on disk names, so it never misses a process."""
        started: list[Proc] = []
        with interrupts_held():
            try:
                yield started
                write_record(self.state_dir, self.record)
            except BaseException:
                supervisor.stop(started, timeout=5.0)
                raise

    def harnesses(self) -> None:
        for node in self.cluster.nodes:
            d = node_dir(self.state_dir, node.name)
            with self._starting() as started:
                kubelet = self.runtime._start_kubelet(node, self.state_dir)
                started.append(kubelet)
                self.kubelets[node.name] = kubelet
                self.record = self.record.with_node(node.name, NodeRecord(
                    root=str(d / "root"), socket=str(d / "control.sock"),
                    kubelet_dir=str(d / "kubelet"),
                    status_file=str(d / "kubelet-status.json"),
                    procs={"kubelet": kubelet.to_json()}))
                # Recorded as the plugin: the "plugin" step's undo stops it, go or not.
                plugin = _start_plugin(d)
                started.append(plugin)
                self._add_proc(node.name, "plugin", plugin)

    def mounts(self) -> None:
        # Every server serves the spec resolved here, not its own reading of the profile.
        spec_file = self.state_dir / "spec.json"
        spec_file.write_text(spec.dump(self.cluster))
        self.record = replace(self.record, spec=str(spec_file))
        starting = {}
        with self._starting() as started:
            for node in self.cluster.nodes:
                d = node_dir(self.state_dir, node.name)
                self.progress(f"{node.name}: mounting fake /sys, /dev, /proc at {d / 'root'}")
                starting[node.name] = start_node(
                    None, node.base_name, d / "root", index=node.index, state_dir=d,
                    log_file=d / "mount.log", spec_file=spec_file)
                started.append(starting[node.name])
                self._add_proc(node.name, "mount", starting[node.name])
        for node in self.cluster.nodes:
            try:
                wait_node(starting[node.name])
            except SandboxError as exc:
                raise RuntimeBackendError(f"mount {node.name}", str(exc)) from exc

    def plugins(self) -> None:
        for node in self.cluster.nodes:
            d = node_dir(self.state_dir, node.name)
            try:
                supervisor.wait_ready(self.kubelets[node.name], READY_TIMEOUT)
            except SandboxError as exc:
                raise RuntimeBackendError(f"kubelet harness {node.name}", str(exc)) from exc
            self.progress(f"{node.name}: fake hardware and kubelet harness up; starting the "
                          "reference device plugin")
            (d / PLUGIN_GO).touch()

    def advertised(self) -> None:
        for node in self.cluster.nodes:
            self.runtime._wait_advertised(node, self.state_dir, self.progress)


def _steps(state_dir: Path, progress: Progress, up: _Up | None = None) -> list[Step]:
    """``up``'s steps (with their ``do``s when given an ``_Up``); ``down`` undoes the same
    list."""
    steps = [Step(name, undo=_undo(state_dir, name, progress))
             for name in ("kubelet harness", "mount", "plugin")] + [Step("advertised")]
    if up is None:
        return steps
    dos = [up.harnesses, up.mounts, up.plugins, up.advertised]
    return [replace(step, do=do) for step, do in zip(steps, dos, strict=True)]


def _undo(state_dir: Path, what: str, progress: Progress) -> Callable[[], None]:
    """Stop the recorded ``what`` processes of every node (kubelet harness, mount,
    plugin); for ``mount`` also unmount the trees. Reads the record when it runs, so it
    works in a later ``down`` as in a failed ``up``."""
    key = {"kubelet harness": "kubelet"}.get(what, what)

    def undo() -> None:
        nodes = (read_record(state_dir) or SandboxRecord()).nodes
        supervisor.stop([p for info in nodes.values()
                         if (p := _procs(info).get(key)) is not None], timeout=5.0)
        if key != "mount":
            return
        problems = []
        for name, info in nodes.items():
            try:
                unmount(Path(info.root or node_dir(state_dir, name) / "root"))
            except SandboxError as exc:
                problems.append(str(exc))
            progress(f"{name}: stopped")
        if problems:
            raise SandboxError("; ".join(problems))

    return undo


def _node_info(state_dir: Path, node: str) -> NodeRecord:
    info = (read_record(state_dir) or SandboxRecord()).node(node)
    if info is None:
        raise SandboxError(f"no node {node!r} in sandbox {state_dir.name!r}")
    return info


def _registered(info: NodeRecord) -> frozenset[str]:
    if info.status_file is None:
        return frozenset()
    return frozenset(r.name for r in read_status(Path(info.status_file)) if r.connected)


def _procs(info: NodeRecord) -> dict[str, Proc]:
    """The processes recorded for a node. ``Proc`` knows each one's start time, so a pid
    the kernel gave to another process since is never signalled."""
    out = {}
    for what, obj in info.procs.items():
        with contextlib.suppress(KeyError, TypeError, ValueError):
            out[what] = Proc.from_json(obj)
    return out


def _start_plugin(d: Path) -> Proc:
    """The node's reference plugin, imported and waiting for ``PLUGIN_GO`` in ``d``
    (``sandbox.prestart``; it gives up after ``PLUGIN_HOLD`` s)."""
    (d / PLUGIN_GO).unlink(missing_ok=True)
    return supervisor.spawn(
        f"plugin {d.name}",
        [sys.executable, "-m", "sandbox.prestart", str(d / PLUGIN_GO), str(PLUGIN_HOLD),
         PLUGIN_MODULE, "--root", str(d / "root"), "--kubelet-dir", str(d / "kubelet"),
         # Rescan on the tree's change events, not every second (idle CPU).
         "--watch", str(d / "control.sock")], d / "plugin.log")


def _import_discovery() -> None:
    with contextlib.suppress(ImportError):  # _advertised's own import says why
        importlib.import_module("hwplugins.deviceplugin.discovery")


def _plugin_serving(kubelet_dir: Path) -> bool:
    """A plugin's socket is in the device-plugins directory (besides the harness's own)."""
    try:
        return any(n.endswith(".sock") and n != "kubelet.sock" for n in os.listdir(kubelet_dir))
    except OSError:
        return False


def _advertised(root: Path, warm: bool = False) -> int:
    """How many devices our plugin advertises on a node's live tree, asked of the plugin's
    own discovery and grouping (hwplugins), so the wait cannot drift from its rules. On a
    ``warm`` tree (the plugin's scan just read it) one reader is fastest."""
    from hwplugins.deviceplugin import discover

    return len(discover(root, readers=1) if warm else discover(root))
