"""What a real kubelet decided, read from its pod-resources API (v1): which container holds
which devices, exclusive CPUs and memory, and what the kubelet can hand out at all.

    list_allocations(socket) -> [Allocation]          every active pod (List)
    get_pod(socket, namespace, name) -> [Allocation]  one pod (Get; KubeletPodResourcesGet)
    allocatable(socket) -> Allocatable                (GetAllocatableResources)
    read_node(socket) -> ([Allocation], Allocatable)  both, on one connection

The kubelet serves the API at ``<kubelet root>/pod-resources/kubelet.sock`` (``socket_for``),
root's only. It reports one ``ContainerDevices`` per device and NUMA node, in Go map
order; here they are grouped into one ``Allocation`` per (container, resource), sorted.
Client only, over grpcio and our own stubs (``hwplugins.api.podresources_v1``); every
failure is a ``KubeletError`` of one line naming the socket and what to do.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from hwplugins.api import podresources_v1_pb2 as pb
from hwplugins.api import podresources_v1_pb2_grpc as pb_grpc

from sandbox.errors import KubeletError

SOCKET = Path("pod-resources") / "kubelet.sock"  # below the kubelet's --root-dir
TIMEOUT = 5.0  # seconds per call
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its NUL; grpcio refuses longer
# A node with many pods answers List with more than grpcio's default 4 MiB (clients of
# this API upstream, e.g. node-feature-discovery, allow 16 MiB).
_OPTIONS = [("grpc.max_receive_message_length", 16 * 2**20)]

_lister: Callable[[grpc.Channel], Any] = pb_grpc.PodResourcesListerStub


def socket_for(kubelet_root: Path) -> Path:
    """Where a kubelet with ``--root-dir=kubelet_root`` serves the pod-resources API."""
    return kubelet_root / SOCKET


@dataclass(frozen=True)
class Memory:
    """Memory the kubelet's memory manager pinned (``ContainerMemory``), or can pin."""

    type: str  # "memory" or "hugepages-<size>", as the kubelet names it
    size: int  # bytes
    numa: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "size": self.size, "numa": list(self.numa)}


@dataclass(frozen=True)
class Allocation:
    """What one container holds of one resource.

    One per (container, resource) with devices: their ids as the device plugin named
    them, sorted, and the NUMA nodes the kubelet reports for them. The container's
    exclusive CPUs and pinned memory go on its first row only, so summing over rows
    counts each once; a container with CPUs or memory but no devices gets one row of
    resource ``cpu`` (``memory`` with no CPUs either), whose ``numa`` is its memory's.
    """

    namespace: str
    pod: str
    container: str
    resource: str
    devices: tuple[str, ...] = ()
    numa: tuple[int, ...] = ()
    cpus: tuple[int, ...] = ()
    memory: tuple[Memory, ...] = ()

    @property
    def holder(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "pod": self.pod, "container": self.container,
                "resource": self.resource, "devices": list(self.devices),
                "numa": list(self.numa), "cpus": list(self.cpus),
                "memory": [m.to_dict() for m in self.memory]}


@dataclass(frozen=True)
class Device:
    """One device the kubelet could allocate, with the NUMA nodes its plugin reported."""

    resource: str
    id: str
    numa: tuple[int, ...]


@dataclass(frozen=True)
class Allocatable:
    """``GetAllocatableResources``: everything the kubelet can hand out, held or not.

    ``cpus`` are the CPUs its CPU manager can give exclusively (all but the reserved
    ones; none unless the policy is ``static``); ``memory`` one entry per type and NUMA
    node (none unless the memory manager's policy is ``Static``)."""

    devices: tuple[Device, ...] = ()
    cpus: tuple[int, ...] = ()
    memory: tuple[Memory, ...] = ()

    def by_resource(self) -> dict[str, tuple[Device, ...]]:
        out: dict[str, list[Device]] = {}
        for d in self.devices:
            out.setdefault(d.resource, []).append(d)
        return {k: tuple(v) for k, v in out.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"devices": {res: [{"id": d.id, "numa": list(d.numa)} for d in devs]
                            for res, devs in self.by_resource().items()},
                "cpus": list(self.cpus), "memory": [m.to_dict() for m in self.memory]}


# -- the calls ----------------------------------------------------------------------------

def list_allocations(socket: Path, timeout: float = TIMEOUT) -> list[Allocation]:
    """Every active pod's devices, exclusive CPUs and memory (the List RPC)."""
    with _connect(socket) as stub:
        response = _call(socket, stub, "List", pb.ListPodResourcesRequest(), timeout)
    return [a for pod in _sorted_pods(response.pod_resources) for a in _pod(pod)]


def get_pod(socket: Path, namespace: str, name: str,
            timeout: float = TIMEOUT) -> list[Allocation]:
    """One pod's holdings (the Get RPC; empty when it holds nothing); KubeletError when
    the kubelet does not know the pod."""
    request = pb.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace)
    with _connect(socket) as stub:
        response = _call(socket, stub, "Get", request, timeout, pod=f"{namespace}/{name}")
    return _pod(response.pod_resources)


def allocatable(socket: Path, timeout: float = TIMEOUT) -> Allocatable:
    """What the kubelet can allocate at all (GetAllocatableResources)."""
    with _connect(socket) as stub:
        response = _call(socket, stub, "GetAllocatableResources",
                         pb.AllocatableResourcesRequest(), timeout)
    return _allocatable(response)


def read_node(socket: Path, timeout: float = TIMEOUT) -> tuple[list[Allocation], Allocatable]:
    """``list_allocations`` and ``allocatable`` on one connection (``sandbox status``)."""
    with _connect(socket) as stub:
        listed = _call(socket, stub, "List", pb.ListPodResourcesRequest(), timeout)
        can = _call(socket, stub, "GetAllocatableResources", pb.AllocatableResourcesRequest(),
                    timeout)
    return ([a for pod in _sorted_pods(listed.pod_resources) for a in _pod(pod)],
            _allocatable(can))


# -- the connection -----------------------------------------------------------------------

def check_socket(socket: Path) -> None:
    """KubeletError when ``socket`` cannot be a kubelet's socket this process may use:
    too long for a unix socket path, missing, not a socket, not ours to write."""
    length = len(os.fsencode(socket))
    if length > MAX_SOCKET_PATH:
        raise KubeletError(
            f"{socket}: {length} bytes, longer than a unix socket path can be "
            f"({MAX_SOCKET_PATH}): use a shorter state dir (HWSANDBOX_STATE_DIR) or kubelet "
            "root (HWSANDBOX_KUBELET_ROOT)")
    try:
        mode = os.stat(socket).st_mode
    except FileNotFoundError:
        raise KubeletError(f"{socket}: no such socket; is the node's kubelet running?") from None
    except OSError as exc:
        raise KubeletError(f"{socket}: {exc.strerror}; the kubelet's socket is root's: run "
                           "as root") from exc
    if not stat.S_ISSOCK(mode):
        raise KubeletError(f"{socket}: not a socket; is the kubelet root right?")
    if not os.access(socket, os.R_OK | os.W_OK):
        raise KubeletError(f"{socket}: permission denied; the kubelet's socket is root's: "
                           "run as root")


@contextmanager
def _connect(socket: Path) -> Iterator[Any]:
    check_socket(socket)
    channel = grpc.insecure_channel(f"unix:{os.path.abspath(socket)}", options=_OPTIONS)
    try:
        yield _lister(channel)
    finally:
        channel.close()


def _call(socket: Path, stub: Any, method: str, request: Any, timeout: float,
          pod: str = "") -> Any:
    try:
        return getattr(stub, method)(request, timeout=timeout)
    except grpc.RpcError as exc:
        raise _error(socket, method, exc, timeout, pod) from exc


def _error(socket: Path, method: str, exc: grpc.RpcError, timeout: float,
           pod: str) -> KubeletError:
    if not isinstance(exc, grpc.Call):
        return KubeletError(f"{socket}: {method} failed: {exc}")
    code, details = exc.code(), " ".join((exc.details() or "").split())
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return KubeletError(f"{socket}: the kubelet did not answer {method} within "
                            f"{timeout:g} s; is it hung? (its log says)")
    if code == grpc.StatusCode.UNAVAILABLE:
        return KubeletError(f"{socket}: nothing answers there ({details}); is the node's "
                            "kubelet running?")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return KubeletError(f"{socket}: the kubelet does not serve {method} ({details}); "
                            "it is older than this API")
    if method == "Get" and "disabled" in details:
        return KubeletError(f"{socket}: the kubelet's Get RPC is off ({details}): enable its "
                            "feature gate KubeletPodResourcesGet (on by default from 1.34)")
    if method == "Get" and "not found" in details:
        return KubeletError(f"pod {pod}: the kubelet at {socket} does not know it ({details});"
                            " is it running on this node? (kubectl get pod -o wide)")
    return KubeletError(f"{socket}: {method} failed: {code.name}: {details}")


# -- the kubelet's messages as our data ---------------------------------------------------

def natural(text: str) -> tuple[Any, ...]:
    """nvidia2 before nvidia10."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def _numa(topology: Any) -> set[int]:
    return {int(n.ID) for n in topology.nodes} if topology is not None else set()


def _grouped(devices: Iterable[Any]) -> dict[str, dict[str, set[int]]]:
    """resource -> device id -> NUMA nodes, merged over the kubelet's per-NUMA entries."""
    out: dict[str, dict[str, set[int]]] = {}
    for group in devices:
        ids = out.setdefault(group.resource_name, {})
        numa = _numa(group.topology) if group.HasField("topology") else set()
        for dev_id in group.device_ids:
            ids.setdefault(dev_id, set()).update(numa)
    return out


def _memory(entries: Iterable[Any]) -> tuple[Memory, ...]:
    found = [Memory(m.memory_type, int(m.size),
                    tuple(sorted(_numa(m.topology) if m.HasField("topology") else ())))
             for m in entries]
    return tuple(sorted(found, key=lambda m: (m.type, m.numa)))


def _sorted_pods(pods: Iterable[Any]) -> list[Any]:
    return sorted(pods, key=lambda p: (p.namespace, p.name))


def _pod(pod: Any) -> list[Allocation]:
    out: list[Allocation] = []
    for c in pod.containers:  # the kubelet's order: restartable init containers, then spec
        cpus = tuple(sorted(int(i) for i in c.cpu_ids))
        memory = _memory(c.memory)
        rows = [Allocation(pod.namespace, pod.name, c.name, resource,
                           tuple(sorted(ids, key=natural)),
                           tuple(sorted({n for numa in ids.values() for n in numa})))
                for resource, ids in sorted(_grouped(c.devices).items())]
        if rows:
            first = rows[0]
            rows[0] = Allocation(first.namespace, first.pod, first.container, first.resource,
                                 first.devices, first.numa, cpus, memory)
        elif cpus or memory:
            numa = tuple(sorted({n for m in memory for n in m.numa}))
            rows = [Allocation(pod.namespace, pod.name, c.name, "cpu" if cpus else "memory",
                               (), numa, cpus, memory)]
        out.extend(rows)
    return out


def _allocatable(response: Any) -> Allocatable:
    devices = tuple(Device(resource, dev_id, tuple(sorted(numa)))
                    for resource, ids in sorted(_grouped(response.devices).items())
                    for dev_id, numa in sorted(ids.items(), key=lambda kv: natural(kv[0])))
    return Allocatable(devices, tuple(sorted(int(i) for i in response.cpu_ids)),
                       _memory(response.memory))
