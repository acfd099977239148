"""The one small interface every runtime backend implements (like kind's Provider).

A runtime turns a resolved ``Cluster`` into running nodes whose device plugins see the
profile's hardware. Backends: ``local`` (FUSE trees + our plugins + the kubelet harness,
no Kubernetes), ``native`` (a real single-node Kubernetes built from source, run as host
processes), ``kind`` (kind clusters in Docker). Each lives in its own module; the CLI
verbs only pick one and call it.

State of one sandbox lives under ``state_dir`` (default ``/run/hw-sandbox/<name>``):
``sandbox.json`` (``record.SandboxRecord``) plus whatever the backend keeps there.
Names are DNS labels (``check_name``), so a state dir is always a direct child of the state
root; ``record.write_record`` creates it with a ``.hw-sandbox-state`` marker, and
``remove_state_dir`` removes only a marked directory, never following symlinks and never
crossing into a mount (``remove_marked_dir``: the same for any directory a runtime marks).

``StateLock`` is the lock of one state dir (``flock`` on the directory itself): ``sandbox
up`` holds it from before the first record is written until it exits, ``sandbox down``
while it removes; each refuses the name while the other holds it, so a ``down`` never
removes what an ``up`` is still making (nor an ``up`` makes into what a ``down`` removes).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sandbox.errors import OptionRefused, SandboxError
from sandbox.profile.spec import Cluster, NodeSpec
from sandbox.progress import Progress
from sandbox.runtimes.record import STATE_MARKER, check_name

if TYPE_CHECKING:  # grpcio is loaded only where a kubelet is asked (add_pod_resources)
    from sandbox.podresources import Allocatable, Allocation

STDIN_COPY = "profile.yaml"  # `sandbox up -`: the profile read from stdin, kept for status


def default_state_root() -> Path:
    return Path(os.environ.get("HWSANDBOX_STATE_DIR", "/run/hw-sandbox"))


def state_dir_for(name: str, root: Path | None = None) -> Path:
    """The state directory of sandbox ``name``: always a direct child of the state root."""
    return (root or default_state_root()) / check_name(name)


@dataclass
class ResourceStatus:
    """What a kubelet advertises for one extended resource on one node."""

    resource: str
    capacity: int
    allocatable: int
    by_numa: dict[int, int] = field(default_factory=dict)  # healthy devices per NUMA node


@dataclass
class DeviceStatus:
    id: str
    kind: str
    model: str
    numa_node: int
    pci_address: str
    health: str  # healthy | unhealthy | unplugged
    reason: str | None = None
    allocated_to: str | None = None
    # SR-IOV VFs as set live (None: the profile's count); per port where set apart
    num_vfs: int | None = None
    port_vfs: dict[int, int] = field(default_factory=dict)


@dataclass
class NodeStatus:
    name: str
    ready: bool
    devices: list[DeviceStatus] = field(default_factory=list)
    resources: list[ResourceStatus] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # what of ours runs for this node but is not running now (the notes say more)
    down: list[str] = field(default_factory=list)
    # What the node's real kubelet decided (its pod-resources API: ``add_pod_resources``);
    # allocatable None: not asked (no real kubelet) or it did not answer (see notes).
    allocations: list[Allocation] = field(default_factory=list)
    allocatable: Allocatable | None = None


@dataclass
class SandboxStatus:
    name: str
    runtime: str
    profile: str
    nodes: list[NodeStatus] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for node, data in zip(self.nodes, out["nodes"], strict=True):
            data["allocations"] = [a.to_dict() for a in node.allocations]
            data["allocatable"] = node.allocatable.to_dict() if node.allocatable else None
        return out


def refuse_options(runtime: str, **given: object) -> None:
    """OptionRefused for the first option in ``given`` that is set (truthy): a runtime's
    constructor lists the options it does not have with the values it was given."""
    for option, value in given.items():
        if value:
            raise OptionRefused(runtime, option)


class Runtime(Protocol):
    name: str

    def unavailable_reason(self) -> str | None:
        """None when this backend can run here, else a one-line reason with a hint."""

    def up(self, cluster: Cluster, profile_path: str, state_dir: Path, progress: Progress) -> None:
        """Create everything; on failure raise RuntimeBackendError naming the step."""

    def down(self, state_dir: Path, progress: Progress) -> None:
        """Remove everything ``up`` made (processes, mounts, device nodes, state)."""

    def status(self, state_dir: Path) -> SandboxStatus: ...

    def restart_kubelet(self, state_dir: Path, node: str) -> None: ...

    def registered_plugins(self, state_dir: Path, node: str) -> frozenset[str]:
        """What is registered with the node's kubelet now (device plugins' resources or
        sockets, DRA drivers' registration sockets): compared before and after a kubelet
        restart to tell when the plugins have registered again."""

    def pod_resources_socket(self, state_dir: Path, node: str) -> Path | None:
        """Where this process reaches the node's kubelet's pod-resources API (a path on
        this host); None when the runtime runs no real kubelet."""

    def reach(self, state_dir: Path, node: str, socket: Path) -> AbstractContextManager[Path]:
        """A path this process can connect to in place of ``socket``, one of the node's
        sockets as recorded (its control socket, ``pod_resources_socket``): ``socket``
        itself, except where a runtime reaches its nodes another way (kind's exec
        transport, ``runtimes.kind.transport``). Use it for the block's length only."""

    def load_images(self, state_dir: Path, images: Sequence[str], archives: Sequence[Path],
                    progress: Progress) -> None:
        """Put local Docker ``images`` and image ``archives`` (``docker save`` or OCI
        layout tars) into the nodes' container runtime, one progress line each, so pods
        run them without a registry; SandboxError where the runtime runs no containers."""


def device_statuses(devices: dict[str, dict[str, Any]]) -> list[DeviceStatus]:
    """What a node's control socket says of its devices (``ControlClient.devices``), as
    the statuses ``sandbox status`` shows."""
    out = []
    for dev_id, dev in devices.items():
        state = dev.get("state", {})
        health = "unplugged" if not state.get("plugged", True) else str(state.get("health"))
        ports = state.get("port_vfs") or {}
        out.append(DeviceStatus(dev_id, dev.get("kind", ""), dev.get("model", ""),
                                int(dev.get("numa_node", -1)), dev.get("pci_address", ""),
                                health, state.get("reason"), num_vfs=state.get("num_vfs"),
                                port_vfs={int(p): int(n) for p, n in ports.items()}))
    return out


def add_devices(node: NodeStatus, socket: Path) -> bool:
    """Fill ``node.devices`` from its control socket; False, with a note, when the fake
    hardware server does not answer."""
    from sandbox.errors import SandboxError
    from sandbox.fakehw.control import ControlClient

    try:
        with ControlClient(socket, timeout=5) as client:
            devices = client.devices()
    except (SandboxError, OSError) as exc:
        node.notes.append(f"fake hardware server not answering: {exc}")
        return False
    node.devices.extend(device_statuses(devices))
    return True


def add_pod_resources(node: NodeStatus, socket: Path | None) -> None:
    """Fill ``node.allocations`` and ``node.allocatable`` from the kubelet's pod-resources
    API at ``socket`` (``Runtime.pod_resources_socket``; None: nothing to ask); where it
    cannot be asked, a note says why."""
    if socket is None:
        return
    from sandbox.podresources import read_node

    try:
        node.allocations, node.allocatable = read_node(socket)
    except SandboxError as exc:
        node.notes.append(f"pod-resources: {exc}")


class StateBusy(SandboxError):
    """Another ``sandbox up`` or ``sandbox down`` holds the sandbox's ``StateLock``."""


class StateLock:
    """The lock of one sandbox's state dir: an exclusive ``flock`` on the directory
    itself, taken without waiting. Held until ``release`` or until the process exits,
    however it exits (the kernel drops it with the last descriptor; none is inherited by
    a child). ``sandbox up`` keeps it until it exits, so a ``down`` that gets the lock
    knows that ``up`` is over."""

    def __init__(self, state_dir: Path, fd: int, created: bool) -> None:
        self.state_dir, self._fd, self.created = state_dir, fd, created

    @classmethod
    def acquire(cls, state_dir: Path, *, create: bool = False,
                wait: float = 0.0) -> StateLock | None:
        """Lock ``state_dir`` (first making it, mode 0700, when ``create``; ``created``
        says whether this call did). None when it does not exist (and not ``create``);
        StateBusy when another process holds it. Only for a dir this call made, the lock
        is waited for, up to ``wait`` seconds: whoever holds one made a moment ago is
        most likely a ``down`` looking whether it is busy (``check_free``)."""
        check_name(state_dir.name)
        created = False
        if create:
            state_dir.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            with contextlib.suppress(FileExistsError):
                state_dir.mkdir(mode=0o700)
                created = True
        try:
            fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if create:
                raise
            return None
        except OSError as exc:  # a symlink (ELOOP), a file (ENOTDIR)
            raise SandboxError(f"{state_dir}: exists and was not made by `sandbox up`; not "
                               f"using it ({exc.strerror})") from None
        deadline = time.monotonic() + (wait if created else 0.0)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return cls(state_dir, fd, created)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise StateBusy(
                        f"sandbox {state_dir.name!r} is coming up or going down: another "
                        "`sandbox up` or `sandbox down` of it is still running") from None
                time.sleep(0.05)
            except BaseException:
                os.close(fd)
                raise

    @classmethod
    def check_free(cls, state_dir: Path) -> None:
        """StateBusy when another process holds the lock now (taken and dropped at once);
        nothing when it is free, or there is no such dir (or not one of ours)."""
        try:
            lock = cls.acquire(state_dir)
        except StateBusy:
            raise
        except SandboxError:
            return
        if lock is not None:
            lock.release()

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def remove_state_dir(state_dir: Path) -> None:
    """``rm -r`` of a state dir ``write_record`` made (see ``remove_marked_dir``)."""
    check_name(state_dir.name)
    remove_marked_dir(state_dir, STATE_MARKER)


def remove_marked_dir(path: Path, marker: str) -> None:
    """``rm -r`` of a directory this program made and marked with the file ``marker``:
    refuses anything unmarked, never follows a symlink (every step is relative to an
    open directory), and refuses to cross into a mount point instead of removing what a
    live mount holds. Nothing there is not an error."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SandboxError(f"{path}: not removing it: {exc.strerror}") from exc
    try:
        try:
            st = os.stat(marker, dir_fd=top, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise SandboxError(f"{path}: no {marker} marker; it was not made by "
                               "`sandbox up`, so it is not removed")
        _empty_dir(top, os.fstat(top).st_dev, str(path))
    finally:
        os.close(top)
    os.rmdir(path)


def _empty_dir(fd: int, dev: int, shown: str) -> None:
    for name in os.listdir(fd):
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as exc:  # ENOTCONN: a dead FUSE mount is still a mount
            raise SandboxError(f"{shown}/{name}: {exc.strerror}; not removing it") from exc
        if not stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
            continue
        if st.st_dev != dev:
            raise SandboxError(f"{shown}/{name} is a mount point; not removing it")
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        try:
            _empty_dir(sub, dev, f"{shown}/{name}")
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=fd)


def advertisable(node: NodeSpec, plugged: int) -> int:
    """How many devices our plugin will advertise on ``node``, estimated from the spec
    alone, for a runtime with no tree on the host (kind); where the tree is mounted here,
    the plugin's own discovery gives the exact count (``local._advertised``)."""
    count = 0
    for dev in node.devices:
        if dev.gpu is not None:
            count += 1 if not (dev.vendor == "intel" and dev.gpu.num_vfs) else 0
        elif dev.nic is not None:
            count += dev.nic.num_vfs * dev.nic.ports
        elif dev.fpga is not None and dev.fpga.flavor == "dfl":
            count += dev.fpga.ports
    return min(count, max(plugged, 0)) if count else 0
