"""The kubelet side of the driver: gRPC over unix sockets, adapting calls to the driver.

Two servers, started in the kubelet's order of expectations (serve first, then register):

- ``<plugins dir>/<driver>/dra.sock`` serves DRAPlugin v1 and v1beta1 (NodePrepareResources,
  NodeUnprepareResources) and DRAResourceHealth v1 and v1alpha1 (NodeWatchResources);
- ``<registry dir>/<driver>-reg.sock`` serves pluginregistration's Registration. GetInfo
  answers type DRAPlugin, the driver name, the dra.sock path and the services in the order
  the kubelet should pick them: ``v1.DRAPlugin``, ``v1beta1.DRAPlugin`` (the kubelet takes
  the first it supports), plus ``v1.DRAResourceHealth`` and ``v1alpha1.DRAResourceHealth``
  (optional; the kubelet opens one health stream on the newest it knows: 1.37 v1).

The health stream sends every device of the pool with its health and, for an unhealthy
one, a message naming the fault (``reason: evidence``), which the kubelet shows in pod
status next to each allocated device. A report is sent at once on a change and repeated
every ``HEALTH_RESEND`` seconds; each declares ``HEALTH_TIMEOUT``: a driver that stops
reporting leaves its devices ``Unknown`` that long after its last report (docs/health.md).

A registration socket that disappears or is replaced (someone cleaned the directory) is
served again once its directory is there; the sockets are ``hwplugins.kubeletsock``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import grpc

from hwplugins.api import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    drahealth_v1_pb2,
    drahealth_v1_pb2_grpc,
    drahealth_v1alpha1_pb2,
    drahealth_v1alpha1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)
from hwplugins.dra.state import PreparedClaim
from hwplugins.kubeletsock import AGAIN, KubeletSocket

log = logging.getLogger("hwplugins.dra")

SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth")
HEALTH_RESEND = 10.0  # seconds: a health report is repeated this often even without change
HEALTH_TIMEOUT = 30  # seconds the kubelet may trust one report: 3 resends missed
MAX_MESSAGE = 1024  # characters the kubelet keeps of a message
# logged once the kubelet says it registered the driver: the native runtime's `up` waits
# for this line (a claim's pod started before it fails and waits out a back-off)
REGISTERED = "registered with the kubelet"

_Add = Callable[[object, grpc.Server], None]
_add_registration: _Add = pluginregistration_v1_pb2_grpc.add_RegistrationServicer_to_server
_add_dra: dict[str, _Add] = {
    "v1": dra_v1_pb2_grpc.add_DRAPluginServicer_to_server,
    "v1beta1": dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server,
}
_add_health: dict[str, _Add] = {
    "v1": drahealth_v1_pb2_grpc.add_DRAResourceHealthServicer_to_server,
    "v1alpha1": drahealth_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server,
}


class Backend(Protocol):
    """What the gRPC side needs from the driver."""

    name: str

    def prepare(self, namespace: str, uid: str, name: str) -> PreparedClaim: ...

    def unprepare(self, uid: str) -> None: ...

    def wait_health(
        self, seen: int, timeout: float
    ) -> tuple[int, str, list[tuple[str, bool, str]]]: ...


class _DRAPlugin:
    def __init__(self, backend: Backend, pb: ModuleType) -> None:
        self.backend = backend
        self.pb = pb

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        response = self.pb.NodePrepareResourcesResponse()
        for claim in request.claims:
            out = response.claims[claim.uid]
            try:
                prepared = self.backend.prepare(claim.namespace, claim.uid, claim.name)
            except Exception as exc:  # every failure goes back to the kubelet
                log.warning("prepare %s/%s (%s): %s", claim.namespace, claim.name, claim.uid, exc)
                out.error = str(exc)
                continue
            for d in prepared.devices:
                dev = out.devices.add(request_names=d.request_names, pool_name=d.pool_name,
                                      device_name=d.device_name,
                                      cdi_device_ids=d.cdi_device_ids)  # fmt: skip
                if d.share_id:
                    dev.share_id = d.share_id
        return response

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        response = self.pb.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            out = response.claims[claim.uid]
            try:
                self.backend.unprepare(claim.uid)
            except Exception as exc:
                log.warning("unprepare %s: %s", claim.uid, exc)
                out.error = str(exc)
        return response


class _Health:
    def __init__(self, backend: Backend, stopped: Callable[[], bool], pb: ModuleType) -> None:
        self.backend = backend
        self.stopped = stopped
        self.pb = pb

    def NodeWatchResources(  # noqa: N802
        self, request: Any, context: grpc.ServicerContext
    ) -> Iterator[Any]:
        pb = self.pb
        seen = -1
        last_sent = 0.0
        while context.is_active() and not self.stopped():
            version, pool, devices = self.backend.wait_health(seen, timeout=1.0)
            now = time.time()
            if version == seen and now - last_sent < HEALTH_RESEND:
                continue
            seen, last_sent = version, now
            yield pb.NodeWatchResourcesResponse(devices=[
                pb.DeviceHealth(
                    device=pb.DeviceIdentifier(pool_name=pool, device_name=name),
                    health=pb.HEALTHY if healthy else pb.UNHEALTHY,
                    last_updated_time=int(now),
                    health_check_timeout_seconds=HEALTH_TIMEOUT,
                    message=message[:MAX_MESSAGE],
                )
                for name, healthy, message in devices
            ])  # fmt: skip


class _Registration:
    def __init__(self, name: str, endpoint: Path) -> None:
        self.name = name
        self.endpoint = endpoint
        self.status: tuple[bool, str] | None = None

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return pluginregistration_v1_pb2.PluginInfo(
            type="DRAPlugin", name=self.name, endpoint=str(self.endpoint),
            supported_versions=list(SERVICES),
        )  # fmt: skip

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self.status = (request.plugin_registered, request.error)
        if request.plugin_registered:
            log.info(REGISTERED)
        else:
            log.error("kubelet rejected the registration: %s", request.error)
        return pluginregistration_v1_pb2.RegistrationStatusResponse()


class KubeletPlugin:
    def __init__(self, backend: Backend, plugins_dir: Path, registry_dir: Path) -> None:
        self.backend = backend
        self.endpoint = plugins_dir / backend.name / "dra.sock"
        self.registration_socket = registry_dir / f"{backend.name}-reg.sock"
        self.registration = _Registration(backend.name, self.endpoint)
        self._stopped = False
        self._dra = KubeletSocket(self.endpoint, self._install_dra, threads="dra")
        self._reg = KubeletSocket(self.registration_socket, self._install_registration,
                                  threads="dra")  # fmt: skip

    def start(self) -> None:
        self.endpoint.parent.mkdir(parents=True, exist_ok=True)
        self._dra.serve()
        self._reg.serve()
        log.info("serving %s; registration %s", self.endpoint, self.registration_socket)

    @property
    def registered(self) -> bool:
        """The kubelet has said it registered the driver (NotifyRegistrationStatus)."""
        status = self.registration.status
        return status is not None and status[0]

    def tick(self) -> None:
        """Serve the registration socket again if it was removed or replaced."""
        if self._reg.keep() == AGAIN:
            log.info("registration socket gone: registering again")

    def stop(self) -> None:
        self._stopped = True
        self._reg.stop(2)
        self._dra.stop(2)

    def _install_dra(self, server: grpc.Server) -> None:
        _add_dra["v1"](_DRAPlugin(self.backend, dra_v1_pb2), server)
        _add_dra["v1beta1"](_DRAPlugin(self.backend, dra_v1beta1_pb2), server)
        _add_health["v1"](_Health(self.backend, self._is_stopped, drahealth_v1_pb2), server)
        _add_health["v1alpha1"](_Health(self.backend, self._is_stopped, drahealth_v1alpha1_pb2),
                                server)  # fmt: skip

    def _is_stopped(self) -> bool:
        return self._stopped

    def _install_registration(self, server: grpc.Server) -> None:
        _add_registration(self.registration, server)
