"""The kubelet's plugin watcher for ``plugins_registry`` (DRA drivers, CSI, device plugins).

Polls the directory for sockets (the kubelet uses fsnotify; polling sees the same files),
calls ``GetInfo`` on each new one, validates the answer like the kubelet's handlers and
reports the verdict with ``NotifyRegistrationStatus``. A DRA driver's chosen version is the
FIRST entry of its ``supported_versions`` that the kubelet knows. A socket that vanishes
deregisters its plugin. ``prepare``/``unprepare`` then call the driver's DRAPlugin service.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from hwplugins.api import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)

from sandbox.errors import KubeletError
from sandbox.kubelet.resources import Event

log = logging.getLogger("sandbox.kubelet")

DRA_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
KNOWN_TYPES = ("CSIPlugin", "DevicePlugin", "DRAPlugin")

_registration_stub: Callable[[grpc.Channel], Any] = pluginregistration_v1_pb2_grpc.RegistrationStub
_dra_stubs: dict[str, Callable[[grpc.Channel], Any]] = {
    "v1.DRAPlugin": dra_v1_pb2_grpc.DRAPluginStub,
    "v1beta1.DRAPlugin": dra_v1beta1_pb2_grpc.DRAPluginStub,
}
_dra_messages = {"v1.DRAPlugin": dra_v1_pb2, "v1beta1.DRAPlugin": dra_v1beta1_pb2}


@dataclass(frozen=True)
class RegisteredPlugin:
    type: str
    name: str
    socket: Path
    endpoint: Path
    version: str  # the supported version the kubelet chose


@dataclass(frozen=True)
class Claim:
    namespace: str
    uid: str
    name: str


def choose_version(plugin_type: str, offered: Sequence[str]) -> str | None:
    if plugin_type != "DRAPlugin":
        return offered[0] if offered else None
    return next((v for v in offered if v in DRA_VERSIONS), None)


class PluginWatcher:
    """Watches ``directory`` (a kubelet's plugins_registry) until ``stop()``."""

    def __init__(self, directory: Path, *, interval: float = 0.1, timeout: float = 5.0) -> None:
        self.directory = Path(directory)
        self.interval = interval
        self.timeout = timeout
        self.events: list[Event] = []
        self.plugins: dict[str, RegisteredPlugin] = {}  # by name
        self._seen: dict[Path, tuple[int, int]] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="pluginwatcher")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> PluginWatcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_registered(self, name: str, timeout: float) -> RegisteredPlugin:
        deadline = time.monotonic() + timeout
        with self._cond:
            while name not in self.plugins:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KubeletError(f"plugin {name!r} did not register within {timeout}s")
                self._cond.wait(min(left, 0.2))
            return self.plugins[name]

    def prepare(self, driver: str, claims: Sequence[Claim]) -> dict[str, Any]:
        """NodePrepareResources; returns the per-claim-UID responses."""
        return self._dra_call(driver, "NodePrepareResources", claims)

    def unprepare(self, driver: str, claims: Sequence[Claim]) -> dict[str, Any]:
        return self._dra_call(driver, "NodeUnprepareResources", claims)

    def _dra_call(self, driver: str, method: str, claims: Sequence[Claim]) -> dict[str, Any]:
        plugin = self.plugins.get(driver)
        if plugin is None or plugin.type != "DRAPlugin":
            raise KubeletError(f"no DRA driver {driver!r} registered")
        msgs = _dra_messages[plugin.version]
        request = getattr(msgs, f"{method}Request")(
            claims=[msgs.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        with grpc.insecure_channel(f"unix://{plugin.endpoint}") as channel:
            stub = _dra_stubs[plugin.version](channel)
            try:
                response = getattr(stub, method)(request, timeout=self.timeout)
            except grpc.RpcError as exc:
                raise KubeletError(f"{driver}: {method} failed: {exc}") from exc
        self._record(method, driver, ",".join(c.uid for c in claims))
        return dict(response.claims)

    def _record(self, kind: str, name: str, detail: str = "") -> None:
        with self._cond:
            self.events.append(Event(time.monotonic(), kind, name, detail))
            self._cond.notify_all()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._scan()
            self._stop.wait(self.interval)

    def _scan(self) -> None:
        current: dict[Path, tuple[int, int]] = {}
        try:
            names = sorted(os.listdir(self.directory))
        except OSError:
            names = []
        for name in names:
            path = self.directory / name
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISSOCK(st.st_mode):
                current[path] = (st.st_ino, st.st_ctime_ns)
        for path in set(self._seen) - set(current):
            self._deregister(path)
        for path, ident in current.items():
            if self._seen.get(path) != ident:
                self._deregister(path)
                self._register(path)
        self._seen = current

    def _deregister(self, socket: Path) -> None:
        with self._cond:
            gone = [n for n, p in self.plugins.items() if p.socket == socket]
            for name in gone:
                del self.plugins[name]
        for name in gone:
            self._record("deregister", name, str(socket))

    def _register(self, socket: Path) -> None:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub = _registration_stub(channel)
            try:
                info = stub.GetInfo(pluginregistration_v1_pb2.InfoRequest(), timeout=self.timeout)
            except grpc.RpcError as exc:
                self._record("getinfo-failed", socket.name, str(exc))
                return
            self._record(
                "getinfo",
                info.name,
                f"type={info.type} endpoint={info.endpoint} "
                f"versions={list(info.supported_versions)}",
            )
            error = ""
            version = choose_version(info.type, list(info.supported_versions))
            if info.type not in KNOWN_TYPES:
                error = f"no handler registered for plugin type: {info.type}"
            elif version is None:
                error = (
                    f"none of the versions {list(info.supported_versions)} are supported; "
                    f"kubelet supports {list(DRA_VERSIONS)}"
                )
            elif info.type == "DRAPlugin" and not info.name:
                error = "DRA plugin name is empty"
            endpoint = self.directory / info.endpoint if info.endpoint else socket
            if info.endpoint and os.path.isabs(info.endpoint):
                endpoint = Path(info.endpoint)
            status = pluginregistration_v1_pb2.RegistrationStatus(
                plugin_registered=not error, error=error
            )
            try:
                stub.NotifyRegistrationStatus(status, timeout=self.timeout)
            except grpc.RpcError as exc:
                self._record("notify-failed", info.name, str(exc))
                return
        if error:
            self._record("register-rejected", info.name, error)
            return
        assert version is not None
        with self._cond:
            self.plugins[info.name] = RegisteredPlugin(
                info.type, info.name, socket, endpoint, version
            )
            self._cond.notify_all()
        self._record("register", info.name, f"version={version} endpoint={endpoint}")
