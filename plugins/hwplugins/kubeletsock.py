"""Our unix sockets in the kubelet's directories: served, watched, served and registered again.

The kubelet dials both programs on unix sockets in its directories, and a kubelet restart
(or someone cleaning a directory) deletes or replaces the files there. One helper serves
both, as dra-example-driver leaves its socket plumbing to one kubelet-plugin helper:

    file_id(path)     (st_dev, st_ino, st_ctime_ns), None when absent: a file deleted and
                      made again (a kubelet restart) has another one. Changes are noticed
                      by polling ``stat``, which works on any filesystem
    serve(path, ...)  a started grpc server on ``unix://path``: the path's length and
                      directory checked (``ServeError``), a stale file removed first
    KubeletSocket     one of our sockets, kept served: ``keep()`` serves it, and serves it
                      again when its file was removed or replaced (once its directory is
                      there again)
    Registrar         the device-plugin registration: ``Register`` on ``kubelet.sock``
                      (after we serve), again whenever that socket is new, retried after a
                      failure

The device plugin keeps one socket and one ``Registrar`` per resource; the DRA driver
serves ``dra.sock`` and keeps its registration socket in ``plugins_registry`` served (the
kubelet's plugin watcher dials it, so serving it again is registering again). Socket
permissions are grpcio's (from the process umask); nothing here changes them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

REGISTER_TIMEOUT = 10.0  # seconds; the kubelet itself dials back with a 10 s timeout
RETRY_AFTER = 1.0  # seconds between Register attempts that failed
MAX_SOCKET_PATH = 105  # grpcio refuses longer unix socket paths (sun_path is 108 bytes)
WORKERS = 8  # threads per server

FIRST, AGAIN = "first", "again"  # what KubeletSocket.keep() did

FileId = tuple[int, int, int]
Install = Callable[[grpc.Server], None]  # adds a program's servicers to a new server


class ServeError(Exception):
    """A socket cannot be served (path too long, directory missing...)."""


def file_id(path: Path) -> FileId | None:
    """(st_dev, st_ino, st_ctime_ns): changes when a file is deleted and made again."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def serve(path: Path, install: Install, threads: str) -> grpc.Server:
    """A started grpc server on ``unix://path`` with the servicers ``install`` adds; its
    worker threads are named ``threads``."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ServeError(f"{path}: unix socket path longer than {MAX_SOCKET_PATH} bytes")
    if not path.parent.is_dir():
        raise ServeError(f"{path.parent}: no such directory")
    if os.path.lexists(path):
        path.unlink()  # a stale socket of an earlier run
    server = grpc.server(ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix=threads))
    install(server)
    try:
        server.add_insecure_port(f"unix://{path}")
    except RuntimeError as exc:
        raise ServeError(f"{path}: cannot listen: {exc}") from exc
    server.start()
    return server


class KubeletSocket:
    """One socket of ours, served by a grpc server that ``install`` fills at every serve.
    ``before_stop`` runs before a running server stops (to end its streams)."""

    def __init__(self, path: Path, install: Install, *, threads: str,
                 before_stop: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.path = path
        self._install = install
        self._threads = threads
        self._before_stop = before_stop
        self._server: grpc.Server | None = None
        self._id: FileId | None = None

    @property
    def served(self) -> bool:
        return self._server is not None

    def serve(self) -> None:
        """Serve (again: a running server is stopped first)."""
        self.stop()
        self._server = serve(self.path, self._install, self._threads)
        self._id = file_id(self.path)

    def replaced(self) -> bool:
        """Our socket file was removed or replaced while we serve."""
        return self._server is not None and file_id(self.path) != self._id

    def keep(self) -> str | None:
        """One round of the loop: serve when not served yet (``FIRST``); serve again when the
        file was removed or replaced and its directory is there (``AGAIN``); else None."""
        if self._server is None:
            self.serve()
            return FIRST
        if self.replaced() and self.path.parent.is_dir():
            self.serve()
            return AGAIN
        return None

    def stop(self, grace: float | None = None) -> None:
        """Stop serving; remove the socket file if it is still ours."""
        server, self._server = self._server, None
        if server is None:
            return
        if self._before_stop is not None:
            self._before_stop()
        server.stop(grace).wait(5)
        if self._id is not None and file_id(self.path) == self._id:
            os.unlink(self.path)
        self._id = None


class Registrar:
    """Keeps one registration with the kubelet behind ``kubelet_socket``: ``register`` (an
    RPC on a channel to it) runs when that socket appears or is replaced (a kubelet
    restart), and ``RETRY_AFTER`` after a failure. ``label`` starts each of its log lines;
    ``endpoint`` is what the kubelet is told to dial."""

    def __init__(self, kubelet_socket: Path, register: Callable[[grpc.Channel], None], *,
                 label: str, endpoint: str, log: logging.Logger) -> None:  # fmt: skip
        self.kubelet_socket = kubelet_socket
        self._register_on = register
        self._label = label
        self._endpoint = endpoint
        self._log = log
        self._registered_with: FileId | None = None
        self._next_attempt = 0.0

    def forget(self) -> None:
        """Register again at the next tick (our socket was served anew)."""
        self._registered_with = None

    def tick(self, now: float) -> None:
        kubelet = file_id(self.kubelet_socket)
        if kubelet is None:
            if self._registered_with is not None:
                self._log.warning("%s: %s is gone; waiting for the kubelet", self._label,
                                  self.kubelet_socket)  # fmt: skip
                self._registered_with = None
            return
        if kubelet != self._registered_with and now >= self._next_attempt:
            self._register(kubelet, now)

    def _register(self, kubelet: FileId, now: float) -> None:
        try:
            with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
                self._register_on(channel)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            self._log.warning("%s: Register failed (%s: %s); retrying", self._label, code, detail)
            self._next_attempt = now + RETRY_AFTER
            return
        self._registered_with = kubelet
        self._log.info("%s: registered with %s as %s", self._label, self.kubelet_socket,
                       self._endpoint)  # fmt: skip
