"""hwplugins.kubeletsock: the socket plumbing both plugins share, over real unix sockets.

The device plugin's and the DRA driver's own tests cover it end to end (re-registration
after a kubelet restart, a registration socket served again); these pin the helper's
rules: serve again only when the file was removed or replaced and its directory is there,
remove only our own file, register again only for a new kubelet.sock.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from hwplugins.api import deviceplugin_v1beta1_pb2 as dp
from hwplugins.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from hwplugins.api import pluginregistration_v1_pb2 as reg
from hwplugins.api import pluginregistration_v1_pb2_grpc as reg_grpc
from hwplugins.kubeletsock import (
    AGAIN,
    FIRST,
    MAX_SOCKET_PATH,
    RETRY_AFTER,
    KubeletSocket,
    Registrar,
    ServeError,
)

pytestmark = [pytest.mark.root]

log = logging.getLogger("test.kubeletsock")


class _Info:
    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return reg.PluginInfo(type="DRAPlugin", name="test")

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return reg.RegistrationStatusResponse()


def _install(server: grpc.Server) -> None:
    reg_grpc.add_RegistrationServicer_to_server(_Info(), server)


def _name(path: Path) -> str:
    with grpc.insecure_channel(f"unix://{path}") as channel:
        return str(reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=5).name)


@pytest.fixture
def sock(tmp_path: Path) -> Iterator[KubeletSocket]:
    (tmp_path / "d").mkdir()
    s = KubeletSocket(tmp_path / "d" / "p.sock", _install, threads="test")
    yield s
    s.stop()


def test_keep_serves_once_and_again_after_the_file_was_removed(sock: KubeletSocket) -> None:
    assert sock.keep() == FIRST
    assert _name(sock.path) == "test"
    assert sock.keep() is None
    sock.path.unlink()
    assert sock.replaced()
    assert sock.keep() == AGAIN
    assert _name(sock.path) == "test"
    assert not sock.replaced()


def test_keep_waits_for_a_removed_directory(sock: KubeletSocket) -> None:
    assert sock.keep() == FIRST
    shutil.rmtree(sock.path.parent)
    assert sock.keep() is None
    assert sock.keep() is None
    sock.path.parent.mkdir()
    assert sock.keep() == AGAIN
    assert _name(sock.path) == "test"


def test_stop_removes_only_our_own_file(sock: KubeletSocket) -> None:
    sock.serve()
    sock.stop()
    assert not sock.path.exists()
    sock.serve()
    sock.path.unlink()
    sock.path.write_text("someone else's")
    sock.stop()
    assert sock.path.read_text() == "someone else's"


def test_stop_runs_before_stop_once_per_running_server(tmp_path: Path) -> None:
    calls: list[str] = []
    s = KubeletSocket(tmp_path / "p.sock", _install, threads="test",
                      before_stop=lambda: calls.append("stop"))  # fmt: skip
    s.stop()
    assert calls == []
    s.serve()
    s.serve()  # serving again stops the running server first
    s.stop()
    s.stop()
    assert calls == ["stop", "stop"]


def test_serve_refuses_what_grpcio_cannot_listen_on(tmp_path: Path) -> None:
    long = tmp_path / ("x" * MAX_SOCKET_PATH)
    with pytest.raises(ServeError, match=f"unix socket path longer than {MAX_SOCKET_PATH} bytes"):
        KubeletSocket(long, _install, threads="test").serve()
    with pytest.raises(ServeError, match="no such directory"):
        KubeletSocket(tmp_path / "nodir" / "p.sock", _install, threads="test").serve()


class _Kubelet:
    """The outside boundary: a kubelet's v1beta1 Registration on kubelet.sock."""

    def __init__(self, path: Path, refuse: bool = False) -> None:
        self.requests: list[Any] = []
        self.refuse = refuse
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        dp_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{path}")
        self.server.start()

    def Register(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        if self.refuse:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not now")
        self.requests.append(request)
        return dp.Empty()

    def stop(self) -> None:
        self.server.stop(None).wait(5)


def _registrar(kubelet: Path) -> Registrar:
    def register(channel: grpc.Channel) -> None:
        dp_grpc.RegistrationStub(channel).Register(
            dp.RegisterRequest(version="v1beta1", endpoint="p.sock", resource_name="x.io/y"),
            timeout=5)  # fmt: skip

    return Registrar(kubelet, register, label="x.io/y", endpoint="p.sock", log=log)


def test_registers_again_only_for_a_new_kubelet_socket(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=log.name)
    path = tmp_path / "kubelet.sock"
    registrar = _registrar(path)
    registrar.tick(0.0)  # no kubelet yet: nothing to do, nothing said
    assert caplog.messages == []
    kubelet = _Kubelet(path)
    try:
        registrar.tick(0.0)
        registrar.tick(0.1)
        assert [r.endpoint for r in kubelet.requests] == ["p.sock"]
        assert caplog.messages == [f"x.io/y: registered with {path} as p.sock"]
        registrar.forget()  # our socket was served anew
        registrar.tick(0.2)
        assert len(kubelet.requests) == 2
    finally:
        kubelet.stop()
    path.unlink(missing_ok=True)
    registrar.tick(0.3)
    assert caplog.messages[-1] == f"x.io/y: {path} is gone; waiting for the kubelet"
    restarted = _Kubelet(path)  # a kubelet restart: a new kubelet.sock
    try:
        registrar.tick(0.4)
        assert len(restarted.requests) == 1
    finally:
        restarted.stop()


def test_a_refused_register_is_retried_after_a_pause(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=log.name)
    path = tmp_path / "kubelet.sock"
    kubelet = _Kubelet(path, refuse=True)
    registrar = _registrar(path)
    try:
        registrar.tick(10.0)
        assert caplog.messages == [
            "x.io/y: Register failed (StatusCode.FAILED_PRECONDITION: not now); retrying"]
        kubelet.refuse = False
        registrar.tick(10.0 + RETRY_AFTER / 2)
        assert kubelet.requests == []
        registrar.tick(10.0 + RETRY_AFTER)
        assert len(kubelet.requests) == 1
    finally:
        kubelet.stop()
