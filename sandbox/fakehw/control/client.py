"""The blocking client of a live node's control socket (the CLI, the scenario runner, the
runtimes and the tests use it); the wire format is ``protocol``'s.

It trusts no server: a reply that is not what a hw-sandbox server sends (too long, not
strict UTF-8 JSON, the wrong shape for its request) is a ControlError saying the socket
is "not a hw-sandbox control server", and a refusal's text is shown on one line.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from sandbox.errors import ControlError
from sandbox.fakehw.changes import OPS
from sandbox.fakehw.control.protocol import (
    MAX_REPLY,
    PROTOCOL_VERSION,
    check_socket_path,
    decode_reply,
    encode_line,
)
from sandbox.fakehw.states import state_from_json

MAX_ERROR_TEXT = 500  # characters of a server's error message shown


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
        self, socket_path: str | os.PathLike[str], *, timeout: float | None = 30.0,
        node: str | None = None,
    ) -> None:
        """``node``: the node meant; sent with every request, so that a server serving
        another node refuses instead of changing it."""
        self.socket_path = Path(socket_path)
        self.node = node
        check_socket_path(self.socket_path)
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
        """Send one raw line (newline added if missing) and return the reply, ok or not
        (ControlError if it is not a reply at all)."""
        try:
            self._sock.sendall(line if line.endswith(b"\n") else line + b"\n")
        except OSError as exc:
            raise ControlError(f"{self.socket_path}: send failed: {exc}") from exc
        reply = self._read()
        if "ok" not in reply:
            raise self._impostor('a reply without "ok"')
        return reply

    def call(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Send a request object as is; return the reply whether ok or not."""
        return self.send_line(encode_line(request))

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send ``op`` with ``fields``; return the reply or raise ControlError."""
        self._next_id += 1
        rid = self._next_id
        request = {"v": PROTOCOL_VERSION, "op": op, "id": rid, **fields}
        if self.node is not None:
            request["node"] = self.node
        reply = self.call(request)
        if not reply["ok"]:
            if reply.get("id") is not None and not _is_id(reply["id"], rid):
                raise self._impostor(f"{op} reply: the id of another request")
            error = _one_line(reply["error"])
            if not error.startswith((f"{op}:", f"{op} ")):  # the server may say it already
                error = f"{op}: {error}"
            raise ControlError(error)
        problem = _ok_reply_problem(op, fields, reply, rid)
        if problem is not None:
            raise self._impostor(f"{op} reply: {problem}")
        return reply

    def _read(self) -> dict[str, Any]:
        """The next line: a JSON object with "v", and a string "error" if "ok" is false."""
        try:
            raw = self._file.readline(MAX_REPLY + 1)
        except OSError as exc:
            raise ControlError(f"{self.socket_path}: no reply: {exc}") from exc
        if not raw:
            raise ControlError(f"{self.socket_path}: the server closed the connection")
        if not raw.endswith(b"\n"):
            if len(raw) > MAX_REPLY:
                raise self._impostor(f"a reply longer than {MAX_REPLY} bytes")
            raise ControlError(f"{self.socket_path}: the server closed the connection "
                               "in the middle of a reply")
        if not raw.strip():
            raise self._impostor("an empty reply line")
        try:
            reply = decode_reply(raw)
        except ControlError as exc:
            raise self._impostor(str(exc)) from None
        if not isinstance(reply, dict):
            raise self._impostor("a reply that is not a JSON object")
        if type(reply.get("v")) is not int or reply["v"] != PROTOCOL_VERSION:
            raise self._impostor(f'a reply without "v": {PROTOCOL_VERSION}')
        if "ok" in reply and not isinstance(reply["ok"], bool):
            raise self._impostor('a reply whose "ok" is not true or false')
        if reply.get("ok") is False and not isinstance(reply.get("error"), str):
            raise self._impostor("a refusal without an error message")
        return reply

    def _impostor(self, what: str) -> ControlError:
        return ControlError(
            f"{self.socket_path}: not a hw-sandbox control server ({_one_line(what)})")

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
                raise ControlError(f"watch: {_one_line(event['error'])}")
            problem = _event_problem(event)
            if problem is not None:
                raise self._impostor(f"watch event: {problem}")
            yield event


# -- what a hw-sandbox server replies -----------------------------------------------------
def _one_line(text: str) -> str:
    """``text`` for an error message: control and other unprintable characters escaped
    (one line, no terminal sequences), at most MAX_ERROR_TEXT characters."""
    if len(text) > MAX_ERROR_TEXT:
        text = text[:MAX_ERROR_TEXT] + "..."
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _ok_reply_problem(op: str, fields: Mapping[str, Any], reply: dict[str, Any],
                      rid: int) -> str | None:
    """What is wrong with a successful ``reply`` to request ``rid``, if anything."""
    if not _is_id(reply.get("id"), rid):
        return "the id of another request"
    if reply.get("op") != op:
        return f'"op" is not "{op}"'
    if "seq" in reply and not _is_int(reply["seq"]):
        return '"seq" is not an integer'
    if op == "get":
        return _devices_problem(reply.get("devices"))
    if op in OPS:
        if reply.get("device") != fields.get("device"):
            return "another device"
        if not isinstance(reply.get("changed"), bool):
            return '"changed" is not true or false'
        return _state_problem(reply.get("state"))
    return None


def _devices_problem(devices: object) -> str | None:
    if not isinstance(devices, list):
        return '"devices" is not a list'
    seen: set[str] = set()
    for i, dev in enumerate(devices):
        if not isinstance(dev, dict):
            return f"devices[{i}] is not an object"
        dev_id = dev.get("id")
        if not isinstance(dev_id, str) or not dev_id or not dev_id.isprintable():
            return f'devices[{i}] has no "id"'
        if dev_id in seen:
            return f"devices[{i}]: {dev_id} twice"
        seen.add(dev_id)
        for key in ("kind", "vendor", "model", "pci_address"):  # printed in a table
            if key in dev and not (isinstance(dev[key], str) and dev[key].isprintable()):
                return f"devices[{i}].{key} is not a printable string"
        if "numa_node" in dev and not _is_int(dev["numa_node"]):
            return f"devices[{i}].numa_node is not an integer"
        nodes = dev.get("dev_nodes", [])
        if not isinstance(nodes, list) or not all(isinstance(n, str) and n.isprintable()
                                                  for n in nodes):
            return f"devices[{i}].dev_nodes is not a list of paths"
        problem = _state_problem(dev.get("state"))
        if problem is not None:
            return f"devices[{i}]: {problem}"
    return None


def _state_problem(state: object) -> str | None:
    if not isinstance(state, dict) or "health" not in state or "plugged" not in state:
        return '"state" is not an object with "health" and "plugged"'
    try:
        state_from_json(state, "state")
    except ControlError as exc:
        return str(exc)
    return None


def _event_problem(event: dict[str, Any]) -> str | None:
    if event.get("event") != "change":
        return 'not a "change" event'
    if not _is_int(event.get("seq")):
        return '"seq" is not an integer'
    if event.get("op") not in OPS:
        return f'"op" is not one of {", ".join(OPS)}'
    if not isinstance(event.get("device"), str):
        return '"device" is not a device id'
    return _state_problem(event.get("state"))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_id(value: object, rid: int) -> bool:
    return type(value) is int and value == rid
