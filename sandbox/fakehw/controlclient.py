"""The blocking client of a live node's control socket (the CLI, the scenario runner, the
runtimes and the tests use it); the wire format is ``protocol``'s.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from sandbox.errors import ControlError
from sandbox.fakehw.protocol import MAX_LINE, PROTOCOL_VERSION, encode_line


def _connect(sock: socket.socket, path: str, timeout: float | None) -> None:
    """connect(), retrying while the server's backlog is full: with a timeout the socket is
    non-blocking, and a unix socket then fails with EAGAIN instead of waiting its turn."""
    deadline = time.monotonic() + (timeout if timeout is not None else 30.0)
    delay = 0.001
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


class ControlClient:
    """Blocking client for one control socket; one request at a time per instance.

    Methods that change state raise ControlError when the server refuses; ``call`` and
    ``send_line`` return the raw reply instead (for tests and tools)."""

    def __init__(
        self, socket_path: str | os.PathLike[str], *, timeout: float | None = 30.0
    ) -> None:
        self.socket_path = Path(socket_path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            _connect(self._sock, str(self.socket_path), timeout)
        except OSError as exc:
            self._sock.close()
            hint = " (is the node mounted? see `sandbox status`)"
            if exc.errno == errno.EACCES:
                hint = " (the control socket is root-only)"
            raise ControlError(
                f"cannot connect to {self.socket_path}: {exc.strerror}{hint}"
            ) from exc
        self._file = self._sock.makefile("rb")
        self._next_id = 0

    def close(self) -> None:
        self._file.close()
        self._sock.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- raw ----------------------------------------------------------------------------
    def send_line(self, line: bytes) -> dict[str, Any]:
        """Send one raw line (newline added if missing) and return the decoded reply."""
        try:
            self._sock.sendall(line if line.endswith(b"\n") else line + b"\n")
        except OSError as exc:
            raise ControlError(f"{self.socket_path}: send failed: {exc}") from exc
        return self._read()

    def call(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Send a request object as is; return the reply whether ok or not."""
        return self.send_line(encode_line(request))

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send ``op`` with ``fields``; return the reply or raise ControlError."""
        self._next_id += 1
        reply = self.call({"v": PROTOCOL_VERSION, "op": op, "id": self._next_id, **fields})
        if not reply.get("ok"):
            raise ControlError(f"{op}: {reply.get('error', 'refused')}")
        return reply

    def _read(self) -> dict[str, Any]:
        try:
            raw = self._file.readline(MAX_LINE * 16)
        except OSError as exc:
            raise ControlError(f"{self.socket_path}: no reply: {exc}") from exc
        if not raw:
            raise ControlError(f"{self.socket_path}: the server closed the connection")
        reply = json.loads(raw)
        if not isinstance(reply, dict):
            raise ControlError(f"{self.socket_path}: reply is not an object")
        return reply

    # -- operations -----------------------------------------------------------------------
    def get(self) -> dict[str, Any]:
        """The whole ``get`` reply: ``devices`` plus server info."""
        return self.request("get")

    def devices(self) -> dict[str, dict[str, Any]]:
        """Device id -> description (with ``state``)."""
        return {d["id"]: d for d in self.get()["devices"]}

    def health(self, device: str, health: str, reason: str | None = None) -> dict[str, Any]:
        fields: dict[str, Any] = {"device": device, "health": health}
        if reason is not None:
            fields["reason"] = reason
        return self.request("health", **fields)

    def unplug(self, device: str) -> dict[str, Any]:
        return self.request("unplug", device=device)

    def plug(self, device: str) -> dict[str, Any]:
        return self.request("plug", device=device)

    def set_vfs(self, device: str, num_vfs: int, port: int | None = None) -> dict[str, Any]:
        if port is None:
            return self.request("set-vfs", device=device, num_vfs=num_vfs)
        return self.request("set-vfs", device=device, num_vfs=num_vfs, port=port)

    def watch(self) -> Iterator[dict[str, Any]]:
        """Start watching; returns an iterator of events, one per committed change, that
        ends only when the caller stops (close the client to stop).

        Every change committed after this returns is reported. Switches this connection
        to streaming; use a separate client for requests."""
        self.request("watch")
        return self._events()

    def _events(self) -> Iterator[dict[str, Any]]:
        while True:
            event = self._read()
            if event.get("ok") is False:
                raise ControlError(f"watch: {event.get('error')}")
            yield event
