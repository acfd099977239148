"""The gRPC side: one DevicePlugin server per extended resource, kept registered.

``ResourcePlugin`` adapts the device model (``discovery.Device``) to the v1beta1 API for
one resource and one socket, as real plugins do. Its ``tick`` keeps the kubelet contract
with ``hwplugins.kubeletsock``: serve first, then Register; serve again and re-register when
our socket or kubelet.sock is deleted or replaced (a kubelet restart deletes every socket in
the directory).

``run`` is the process loop: rescan the root when ``hwplugins.watch.Rescans`` says so
(every ``interval`` seconds, or on a live tree's change events), hand each resource its
device list (a change wakes its ListAndWatch streams), tick every plugin.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from hwplugins.api import deviceplugin_v1beta1_pb2 as pb
from hwplugins.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from hwplugins.deviceplugin.cdi import SpecDir
from hwplugins.deviceplugin.config import Config
from hwplugins.deviceplugin.discovery import Device, group
from hwplugins.deviceplugin.packing import pack
from hwplugins.devices import Scanner
from hwplugins.kubeletsock import AGAIN, REGISTER_TIMEOUT, KubeletSocket, Registrar
from hwplugins.watch import Rescans

log = logging.getLogger("hwplugins.deviceplugin")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
TICK = 0.1  # socket watch period, independent of the rescan interval

# The generated grpc module is untyped; pin the two entry points we use to real signatures.
_add_servicer: Callable[[object, grpc.Server], None] = pb_grpc.add_DevicePluginServicer_to_server
_registration_stub: Callable[[grpc.Channel], Any] = pb_grpc.RegistrationStub


def socket_name(prefix: str, resource: str) -> str:
    return f"{prefix}-{resource.replace('/', '_')}.sock"


def _to_pb(device: Device) -> Any:
    topology = (
        pb.TopologyInfo(nodes=[pb.NUMANode(ID=device.numa_node)])
        if device.numa_node is not None
        else None
    )
    return pb.Device(ID=device.id, health=device.health, topology=topology)


def container_response(devices: Sequence[Device]) -> Any:
    """Allocate's answer for one container: device nodes, vendor env, CDI names."""
    env: dict[str, list[str]] = {}
    nodes: dict[str, None] = {}
    for dev in devices:
        for name, value in dev.env:
            env.setdefault(name, []).append(value)
        nodes.update(dict.fromkeys(dev.dev_nodes[:1]))  # each device's own node first
    for dev in devices:
        nodes.update(dict.fromkeys(dev.dev_nodes[1:]))  # then shared ones (nvidiactl, kfd)
    return pb.ContainerAllocateResponse(
        envs={name: ",".join(values) for name, values in env.items()},
        # Host path = container path: the runtime creates the real node on the host's /dev.
        devices=[pb.DeviceSpec(container_path=n, host_path=n, permissions="rw") for n in nodes],
        cdi_devices=[pb.CDIDevice(name=d.cdi_name) for d in devices if d.cdi_name],
    )


class _Servicer:
    """DevicePlugin methods; grpc finds them by name (no generated base class needed)."""

    def __init__(self, plugin: ResourcePlugin, epoch: int) -> None:
        self._plugin = plugin
        self._epoch = epoch

    def GetDevicePluginOptions(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return self._plugin.options()

    def ListAndWatch(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        p = self._plugin
        log.info("%s: ListAndWatch stream opened", p.resource)
        seen = -1
        while True:
            with p.cond:
                while p.generation == seen and p.epoch == self._epoch and context.is_active():
                    p.cond.wait(0.5)
                if p.epoch != self._epoch or not context.is_active():
                    log.info("%s: ListAndWatch stream closed", p.resource)
                    return
                seen, devices = p.generation, p.devices
            yield pb.ListAndWatchResponse(devices=[_to_pb(d) for d in devices])

    def GetPreferredAllocation(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        numa = {d.id: d.numa_node for d in self._plugin.devices}
        response = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            ids = pack(
                list(creq.available_deviceIDs),
                list(creq.must_include_deviceIDs),
                creq.allocation_size,
                numa,
            )
            log.info(
                "%s: GetPreferredAllocation size %d -> %s",
                self._plugin.resource,
                creq.allocation_size,
                ",".join(ids),
            )
            response.container_responses.add(deviceIDs=ids)
        return response

    def Allocate(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        by_id = {d.id: d for d in self._plugin.devices}
        response = pb.AllocateResponse()
        for creq in request.container_requests:
            ids = list(creq.devices_ids)
            unknown = [i for i in ids if i not in by_id]
            if unknown:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{self._plugin.resource}: unknown device ids {', '.join(unknown)}",
                )
            sick = [i for i in ids if not by_id[i].healthy]
            if sick:
                log.warning("%s: allocating unhealthy %s", self._plugin.resource, sick)
            log.info("%s: Allocate %s", self._plugin.resource, ",".join(ids))
            response.container_responses.append(container_response([by_id[i] for i in ids]))
        return response

    def PreStartContainer(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        log.info("%s: PreStartContainer %s", self._plugin.resource, ",".join(request.devices_ids))
        return pb.PreStartContainerResponse()


class ResourcePlugin:
    """Serves and registers one resource on ``<kubelet_dir>/<socket>``."""

    def __init__(
        self,
        resource: str,
        kubelet_dir: Path,
        *,
        socket: str,
        pre_start_required: bool = False,
        preferred_allocation: bool = True,
    ) -> None:
        self.resource = resource
        self.kubelet_dir = kubelet_dir
        self.socket = socket
        self.pre_start_required = pre_start_required
        self.preferred_allocation = preferred_allocation
        self.cond = threading.Condition()
        self.devices: tuple[Device, ...] = ()
        self.generation = 0
        self.epoch = 0  # bumped whenever a server stops, so its streams end
        self._socket = KubeletSocket(self.socket_path, self._install, threads="dp",
                                     before_stop=self._end_streams)  # fmt: skip
        self._registrar = Registrar(self.kubelet_socket, self._register, label=resource,
                                    endpoint=socket, log=log)  # fmt: skip

    @property
    def socket_path(self) -> Path:
        return self.kubelet_dir / self.socket

    @property
    def kubelet_socket(self) -> Path:
        return self.kubelet_dir / KUBELET_SOCKET

    def options(self) -> Any:
        return pb.DevicePluginOptions(
            pre_start_required=self.pre_start_required,
            get_preferred_allocation_available=self.preferred_allocation,
        )

    def set_devices(self, devices: Sequence[Device]) -> bool:
        """Replace the device list; wakes the ListAndWatch streams if anything changed."""
        new = tuple(devices)
        with self.cond:
            if new == self.devices and self.generation > 0:
                return False
            self.devices = new
            self.generation += 1
            self.cond.notify_all()
        return True

    def tick(self, now: float) -> None:
        """Serve before registering; serve and register again when our socket was removed
        or replaced, register again when kubelet.sock was (``hwplugins.kubeletsock``)."""
        served = self._socket.keep()
        if served == AGAIN:
            log.warning("%s: socket %s was removed; serving again", self.resource, self.socket)
            self._registrar.forget()
        if served is not None:
            log.info("%s: serving DevicePlugin on %s", self.resource, self.socket_path)
        self._registrar.tick(now)

    def close(self) -> None:
        self._socket.stop()

    def _install(self, server: grpc.Server) -> None:
        _add_servicer(_Servicer(self, self.epoch), server)

    def _end_streams(self) -> None:
        with self.cond:
            self.epoch += 1
            self.cond.notify_all()

    def _register(self, channel: grpc.Channel) -> None:
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self.socket,
            resource_name=self.resource,
            options=self.options(),
        )
        _registration_stub(channel).Register(request, timeout=REGISTER_TIMEOUT)


def _log_changes(resource: str, old: Sequence[Device], new: Sequence[Device]) -> None:
    before = {d.id: d for d in old}
    after = {d.id: d for d in new}
    for dev_id in sorted(before.keys() - after.keys()):
        log.warning("%s: device %s removed", resource, dev_id)
    for dev_id, dev in sorted(after.items()):
        prev = before.get(dev_id)
        if prev is None:
            log.info(
                "%s: device %s (%s, numa %s) %s%s",
                resource,
                dev_id,
                dev.pci_address,
                dev.numa_node,
                dev.health,
                f": {dev.reason}" if dev.reason else "",
            )
        elif prev.health != dev.health:
            log.warning(
                "%s: device %s now %s%s",
                resource,
                dev_id,
                dev.health,
                f": {dev.reason}" if dev.reason else "",
            )
    healthy = sum(d.healthy for d in new)
    log.info("%s: %d devices, %d healthy", resource, len(new), healthy)


def run(
    root: Path,
    kubelet_dir: Path,
    config: Config,
    *,
    interval: float = 1.0,
    socket_prefix: str = "hwplugins",
    stop: threading.Event,
    watch: Path | None = None,
    resync: float = 30.0,
    cdi_dir: Path | None = None,
) -> None:
    """Rescan, serve and register until ``stop`` is set; then stop every server. With
    ``watch`` (a live tree's control socket) rescan on its change events and every
    ``resync`` seconds, else every ``interval`` seconds (see ``hwplugins.watch``). With
    ``cdi_dir``, the CDI specs of the names Allocate answers with are kept there (written
    before the first registration, so every name resolves)."""
    plugins: dict[str, ResourcePlugin] = {}
    cdi = SpecDir(cdi_dir) if cdi_dir is not None else None
    rescans = Rescans(interval, watch, resync)
    scanner = Scanner(root, config.ignore)
    try:
        while not stop.is_set():
            now = time.monotonic()
            rescan = rescans.due(now)
            if rescan is not None:
                grouped: dict[str, list[Device]] = {}
                found = scanner.scan(rescan.dirty)
                for dev in group(found, config.rules, scanner.root.dev_exists):
                    if not config.only or dev.resource in config.only:
                        grouped.setdefault(dev.resource, []).append(dev)
                if cdi is not None:
                    cdi.update(d for devs in grouped.values() for d in devs)
                for resource in sorted(grouped.keys() | plugins.keys()):
                    plugin = plugins.get(resource)
                    if plugin is None:
                        plugin = plugins[resource] = ResourcePlugin(
                            resource,
                            kubelet_dir,
                            socket=socket_name(socket_prefix, resource),
                            pre_start_required=config.pre_start(resource),
                            preferred_allocation=config.preferred_allocation,
                        )
                    old = plugin.devices
                    if plugin.set_devices(grouped.get(resource, [])):
                        _log_changes(resource, old, plugin.devices)
            for plugin in plugins.values():
                plugin.tick(now)
            if stop.is_set():
                break
            rescans.wait(min(TICK, interval))
    finally:
        rescans.close()
        for plugin in plugins.values():
            plugin.close()
        if cdi is not None:
            cdi.close()
        log.info("stopped")
