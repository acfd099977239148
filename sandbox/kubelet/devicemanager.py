"""The kubelet's device manager, reproduced for tests: Registration server and plugin clients.

``DeviceManager`` serves ``Registration`` on ``<dir>/kubelet.sock`` and behaves as the
kubelet does towards device plugins:

- Register: the version must be supported and the resource an extended resource name;
  then the kubelet dials the plugin's endpoint at once (so the plugin must already be
  serving), calls GetDevicePluginOptions first and keeps one ListAndWatch stream open.
- Each ListAndWatch message replaces the device list: capacity = all devices, allocatable
  = healthy ones. A stream that ends marks every device of the resource unhealthy.
- ``restart()``: what a kubelet restart does to the directory: every socket is deleted
  (the checkpoint file stays), kubelet.sock is made again, all plugin state is forgotten
  until the plugins register again.
- ``allocate()``: TopologyManager hints and policy, GetPreferredAllocation when offered,
  Allocate, then PreStartContainer when the plugin asked for it.

Everything that happens is appended to ``events`` (the protocol log).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from socket import AF_UNIX, SOCK_STREAM
from socket import socket as unix_socket
from typing import Any

import grpc
from hwplugins.api import deviceplugin_v1beta1_pb2 as pb
from hwplugins.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc

from sandbox.errors import AllocationError, KubeletError
from sandbox.kubelet.resources import (
    HEALTHY,
    UNHEALTHY,
    Allocation,
    DeviceInfo,
    Event,
    ResourceState,
    Snapshot,
    is_extended_resource_name,
)
from sandbox.kubelet.topology import Policy, admit, choose_devices, device_hints, format_hints

log = logging.getLogger("sandbox.kubelet")

# Re-exported: what the device manager returns is defined in sandbox.kubelet.resources.
__all__ = [
    "HEALTHY", "UNHEALTHY", "Allocation", "DeviceInfo", "DeviceManager", "Event",
    "ResourceState", "Snapshot", "is_extended_resource_name",
]

KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT = "kubelet_internal_checkpoint"
MAX_SOCKET_PATH = 105  # grpcio refuses longer unix socket paths (sun_path is 108 bytes)
SUPPORTED_VERSIONS = ("v1beta1",)

_add_registration: Callable[[object, grpc.Server], None] = (
    pb_grpc.add_RegistrationServicer_to_server
)
_plugin_stub: Callable[[grpc.Channel], Any] = pb_grpc.DevicePluginStub

# Reconnect quickly: the default 1 s backoff would dominate restart timings.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

@dataclass(eq=False)
class _Endpoint:
    resource: str
    socket: Path
    channel: grpc.Channel
    stub: Any
    options: Any
    devices: dict[str, DeviceInfo] = field(default_factory=dict)
    connected: bool = False
    call: Any = None


class DeviceManager:
    """A kubelet device manager on ``directory`` (its device-plugins directory)."""

    def __init__(
        self,
        directory: Path,
        *,
        numa_nodes: Sequence[int] | None = None,
        dial_timeout: float = 10.0,
        call_timeout: float = 10.0,
    ) -> None:
        self.directory = Path(directory)
        self.numa_nodes = tuple(numa_nodes) if numa_nodes is not None else None
        self.dial_timeout = dial_timeout
        self.call_timeout = call_timeout
        self.events: list[Event] = []
        self._cond = threading.Condition()
        self._endpoints: dict[str, _Endpoint] = {}
        self._allocated: dict[str, set[str]] = {}
        self._server: grpc.Server | None = None
        self._epoch = 0

    # lifecycle ---------------------------------------------------------------------------

    @property
    def socket_path(self) -> Path:
        return self.directory / KUBELET_SOCKET

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise KubeletError(
                f"{self.socket_path}: longer than {MAX_SOCKET_PATH} bytes, too long for a "
                "unix socket (plugin sockets beside it need room too: use a short directory)"
            )
        if os.path.lexists(self.socket_path):
            self.socket_path.unlink()
        server = grpc.server(ThreadPoolExecutor(max_workers=16, thread_name_prefix="kubelet"))
        _add_registration(_RegistrationServicer(self, self._epoch), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        self._write_checkpoint()
        self._record("kubelet-start", "", str(self.socket_path))

    def stop(self) -> None:
        with self._cond:
            self._epoch += 1
            endpoints = list(self._endpoints.values())
            self._endpoints.clear()
            self._cond.notify_all()
        for ep in endpoints:
            self._close(ep)
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None

    def __enter__(self) -> DeviceManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def restart(self) -> None:
        """Kubelet restart: delete every socket but keep the checkpoint; forget all plugins."""
        self._record("restart", "", "deleting sockets, recreating kubelet.sock")
        self.stop()
        for entry in sorted(os.listdir(self.directory)):
            path = self.directory / entry
            if entry == CHECKPOINT:
                continue
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    path.unlink()
            except FileNotFoundError:
                continue
        self.start()

    # state -------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self._cond:
            return self._snapshot_locked()

    def wait_for(
        self, predicate: Callable[[Snapshot], bool], timeout: float, what: str = "condition"
    ) -> Snapshot:
        """Block until ``predicate(snapshot)`` holds; KubeletError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                snap = self._snapshot_locked()
                if predicate(snap):
                    return snap
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KubeletError(
                        f"timed out after {timeout}s waiting for {what}:\n{snap.table()}"
                    )
                self._cond.wait(min(left, 0.2))

    def wait_registered(self, resource: str, timeout: float) -> Snapshot:
        """Until ``resource`` is registered and its first ListAndWatch message has arrived."""
        return self.wait_for(
            lambda s: (
                resource in s.resources
                and s.resources[resource].connected
                and any(e.kind == "devices" and e.resource == resource for e in self._since_start())
            ),
            timeout,
            f"{resource} to register and list its devices",
        )

    def events_of(self, kind: str, resource: str | None = None) -> list[Event]:
        with self._cond:
            return [
                e
                for e in self.events
                if e.kind == kind and (resource is None or e.resource == resource)
            ]

    # allocation --------------------------------------------------------------------------

    def allocate(self, resource: str, count: int, policy: Policy | str = Policy.NONE) -> Allocation:
        """Allocate ``count`` devices for one container, as the kubelet admits a pod."""
        policy = Policy(policy)
        with self._cond:
            ep = self._endpoints.get(resource)
            if ep is None:
                raise AllocationError(f"no device plugin registered for resource {resource}")
            numa_of = {d.id: d.numa_nodes for d in ep.devices.values()}
            taken = self._allocated.setdefault(resource, set())
            available = sorted(
                d.id for d in ep.devices.values() if d.health == HEALTHY and d.id not in taken
            )
            numa_nodes = self.numa_nodes or tuple(sorted({n for v in numa_of.values() for n in v}))
        if len(available) < count:
            raise AllocationError(
                f"requested number of devices unavailable for {resource}. "
                f"Requested: {count}, Available: {len(available)}"
            )
        hints = device_hints(numa_nodes, numa_of, available, count)
        affinity = admit(policy, hints, numa_nodes)
        self._record(
            "topology-hint",
            resource,
            f"policy={policy.value} hints={format_hints(hints)} "
            f"affinity={sorted(affinity.nodes) if affinity else None}",
        )
        preferred = None
        if ep.options.get_preferred_allocation_available:

            def preferred(avail: list[str], must: list[str], size: int) -> list[str]:
                return self._preferred(ep, avail, must, size)

        ids = choose_devices(available, count, affinity, numa_of, preferred)
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]
        )
        try:
            response = ep.stub.Allocate(request, timeout=self.call_timeout)
        except grpc.RpcError as exc:
            self._record("allocate-failed", resource, _rpc_error(exc))
            raise AllocationError(f"{resource}: Allocate failed: {_rpc_error(exc)}") from exc
        if len(response.container_responses) != 1:
            raise AllocationError(
                f"{resource}: Allocate returned "
                f"{len(response.container_responses)} container responses for 1"
            )
        self._record("allocate", resource, ",".join(ids))
        pre_started = False
        if ep.options.pre_start_required:
            try:
                ep.stub.PreStartContainer(
                    pb.PreStartContainerRequest(devices_ids=ids), timeout=self.call_timeout
                )
            except grpc.RpcError as exc:
                raise AllocationError(
                    f"{resource}: PreStartContainer failed: {_rpc_error(exc)}"
                ) from exc
            self._record("pre-start", resource, ",".join(ids))
            pre_started = True
        with self._cond:
            self._allocated.setdefault(resource, set()).update(ids)
            self._write_checkpoint()
        c = response.container_responses[0]
        return Allocation(
            resource=resource,
            device_ids=tuple(ids),
            numa_nodes=frozenset(n for i in ids for n in numa_of.get(i, ())),
            affinity=affinity.nodes if affinity else None,
            envs=dict(c.envs),
            mounts=tuple((m.container_path, m.host_path, m.read_only) for m in c.mounts),
            devices=tuple((d.container_path, d.host_path, d.permissions) for d in c.devices),
            annotations=dict(c.annotations),
            cdi_devices=tuple(d.name for d in c.cdi_devices),
            pre_started=pre_started,
        )

    def release(self, allocation: Allocation) -> None:
        """The container is gone: its devices are free again."""
        with self._cond:
            self._allocated.get(allocation.resource, set()).difference_update(allocation.device_ids)
            self._write_checkpoint()

    def _preferred(self, ep: _Endpoint, avail: list[str], must: list[str], size: int) -> list[str]:
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=avail, must_include_deviceIDs=must, allocation_size=size
                )
            ]
        )
        try:
            resp = ep.stub.GetPreferredAllocation(request, timeout=self.call_timeout)
        except grpc.RpcError as exc:
            raise AllocationError(
                f"{ep.resource}: GetPreferredAllocation failed: {_rpc_error(exc)}"
            ) from exc
        ids = list(resp.container_responses[0].deviceIDs) if resp.container_responses else []
        self._record("preferred-allocation", ep.resource, f"size={size} -> {','.join(ids)}")
        return ids

    # registration (called from the gRPC server) ---------------------------------------

    def _register(self, request: Any, context: grpc.ServicerContext, epoch: int) -> Any:
        resource, endpoint = request.resource_name, request.endpoint
        self._record(
            "register",
            resource,
            f"version={request.version} endpoint={endpoint} options={_options(request.options)}",
        )

        def reject(message: str) -> Any:
            self._record("register-rejected", resource, message)
            context.abort(grpc.StatusCode.UNKNOWN, message)

        if request.version not in SUPPORTED_VERSIONS:
            return reject(
                f"requested API version {request.version!r} is not supported by "
                f"kubelet. Supported versions are {list(SUPPORTED_VERSIONS)}"
            )
        if not is_extended_resource_name(resource):
            return reject(f"the ResourceName {resource!r} is invalid")
        socket = self.directory / endpoint
        # Was the plugin already serving when it registered? (The kubelet dials at once.)
        serving = _probe(socket)
        self._record("dial" if serving else "dial-not-serving", resource, str(socket))
        channel = grpc.insecure_channel(f"unix://{socket}", options=CHANNEL_OPTIONS)
        try:
            grpc.channel_ready_future(channel).result(timeout=self.dial_timeout)
        except grpc.FutureTimeoutError:
            channel.close()
            return reject(
                f"failed to dial device plugin: {socket}: not serving after {self.dial_timeout}s"
            )
        stub = _plugin_stub(channel)
        try:
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=self.call_timeout)
        except grpc.RpcError as exc:
            channel.close()
            return reject(f"GetDevicePluginOptions failed: {_rpc_error(exc)}")
        self._record("options", resource, _options(options))
        ep = _Endpoint(resource, socket, channel, stub, options)
        with self._cond:
            if epoch != self._epoch:  # the kubelet "restarted" while we dialled
                channel.close()
                return pb.Empty()
            old = self._endpoints.get(resource)
            self._endpoints[resource] = ep
            self._cond.notify_all()
        if old is not None:
            self._close(old)
        threading.Thread(
            target=self._watch, args=(ep,), daemon=True, name=f"law-{resource}"
        ).start()
        return pb.Empty()

    def _watch(self, ep: _Endpoint) -> None:
        self._record("list-and-watch", ep.resource, "stream opened")
        reason = "stream completed"
        try:
            ep.call = ep.stub.ListAndWatch(pb.Empty())
            with self._cond:
                ep.connected = self._endpoints.get(ep.resource) is ep
                self._cond.notify_all()
            for response in ep.call:
                devices = {
                    d.ID: DeviceInfo(
                        d.ID,
                        d.health,
                        tuple(n.ID for n in d.topology.nodes) if d.HasField("topology") else (),
                    )
                    for d in response.devices
                }
                with self._cond:
                    if self._endpoints.get(ep.resource) is not ep:
                        return
                    ep.devices = devices
                    self._cond.notify_all()
                healthy = sum(d.health == HEALTHY for d in devices.values())
                self._record("devices", ep.resource, f"{len(devices)} devices, {healthy} healthy")
        except grpc.RpcError as exc:
            reason = _rpc_error(exc)
        with self._cond:
            if self._endpoints.get(ep.resource) is not ep:
                return
            ep.connected = False
            ep.devices = {
                k: DeviceInfo(v.id, UNHEALTHY, v.numa_nodes) for k, v in ep.devices.items()
            }
            self._cond.notify_all()
        self._record("stream-end", ep.resource, f"{reason}; all devices now unhealthy")

    # helpers -------------------------------------------------------------------------------

    def _close(self, ep: _Endpoint) -> None:
        if ep.call is not None:
            ep.call.cancel()
        ep.channel.close()

    def _record(self, kind: str, resource: str, detail: str = "") -> None:
        event = Event(time.monotonic(), kind, resource, detail)
        log.debug("%s", event)
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def _since_start(self) -> Iterator[Event]:
        for e in reversed(self.events):
            if e.kind == "kubelet-start":
                return
            yield e

    def _snapshot_locked(self) -> Snapshot:
        return Snapshot(
            {
                name: ResourceState(
                    name=name,
                    endpoint=ep.socket.name,
                    connected=ep.connected,
                    options=_options_dict(ep.options),
                    devices=tuple(sorted(ep.devices.values(), key=lambda d: d.id)),
                    allocated=frozenset(self._allocated.get(name, ())),
                )
                for name, ep in self._endpoints.items()
            }
        )

    def _write_checkpoint(self) -> None:
        data = {
            "Data": {
                "RegisteredDevices": {},
                "PodDeviceEntries": [
                    {"ResourceName": r, "DeviceIDs": sorted(ids)}
                    for r, ids in sorted(self._allocated.items())
                    if ids
                ],
            }
        }
        (self.directory / CHECKPOINT).write_text(json.dumps(data, indent=1) + "\n")


class _RegistrationServicer:
    def __init__(self, manager: DeviceManager, epoch: int) -> None:
        self._manager = manager
        self._epoch = epoch

    def Register(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return self._manager._register(request, context, self._epoch)


def _probe(socket: Path) -> bool:
    """Can we connect to the socket right now (no waiting for the plugin to appear)? A plain
    connect: a gRPC channel made and closed for this took ~0.2 s even when the plugin was
    serving, on every registration."""
    with contextlib.closing(unix_socket(AF_UNIX, SOCK_STREAM)) as s:
        s.settimeout(0.5)
        try:
            s.connect(str(socket))
        except OSError:
            return False
    return True


def _options_dict(options: Any) -> dict[str, bool]:
    return {
        "pre_start_required": bool(options.pre_start_required),
        "get_preferred_allocation_available": bool(options.get_preferred_allocation_available),
    }


def _options(options: Any) -> str:
    return ",".join(k for k, v in _options_dict(options).items() if v) or "-"


def _rpc_error(exc: grpc.RpcError) -> str:
    if isinstance(exc, grpc.Call):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
