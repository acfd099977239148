"""The control API of a live node: a root-only unix socket speaking line-delimited JSON.

Server side, ``ControlServer`` validates each request, turns it into a ``Change`` for the
``LiveTree``, waits for the filesystem to invalidate what changed, saves the states and
tells watchers. Client side, ``ControlClient`` is the blocking client the CLI, the
scenario runner and the tests use. The wire format is documented in docs/control-api.md.

Where things live (``control_paths``): for a mount at ``ROOT`` the socket is
``ROOT.sock`` and the saved states ``ROOT.state.json``, next to the mount point; with an
explicit ``state_dir`` they are ``state_dir/control.sock`` and ``state_dir/state.json``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import trio

from sandbox.errors import ControlError, MountError
from sandbox.fakehw.live import (
    OPS,
    Change,
    Diff,
    LiveTree,
    Op,
    describe,
    save_states,
    state_to_json,
)
from sandbox.fakehw.tree import Health, Reason

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_LINE = 64 * 1024
WATCH_QUEUE = 1024
# Bounds that keep one hostile client from stopping the server or starving the others:
MAX_CONNECTIONS = 1024  # past this, the connection idle the longest is dropped
MAX_WATCHERS = 256
MAX_DIGITS = 20  # integers in a request (ids, num_vfs) are small
MAX_DEPTH = 8  # requests are flat objects; deeper JSON is refused before it is decoded
LISTEN_BACKLOG = 1024
_SUN_PATH_MAX = 107
_COMMON_KEYS = frozenset({"v", "op", "id"})
_OP_KEYS: dict[str, frozenset[str]] = {
    "get": frozenset(),
    "watch": frozenset(),
    "health": frozenset({"device", "health", "reason"}),
    "unplug": frozenset({"device"}),
    "plug": frozenset({"device"}),
    "set-vfs": frozenset({"device", "num_vfs", "port"}),
}
MAX_VFS = 4096
MAX_PORT = 255  # physical functions of one device (a PCI device has at most 256)


@dataclass(frozen=True)
class ControlPaths:
    """Where a live node's control socket and saved states are."""

    socket: Path
    state: Path


def control_paths(
    root: str | os.PathLike[str], state_dir: str | os.PathLike[str] | None = None
) -> ControlPaths:
    """The socket and state-file paths for a mount at ``root`` (see the module doc)."""
    if state_dir is not None:
        base = Path(state_dir).absolute()
        return ControlPaths(base / "control.sock", base / "state.json")
    r = Path(root).absolute()
    return ControlPaths(r.parent / f"{r.name}.sock", r.parent / f"{r.name}.state.json")


# -- requests -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    op: str
    id: str | int | None
    change: Change | None


def parse_request(obj: object) -> Request:
    """Validate one decoded request. Raises ControlError naming the first problem."""
    if not isinstance(obj, dict):
        raise ControlError("a request must be a JSON object")
    rid = obj.get("id")
    if rid is not None and (not isinstance(rid, str | int) or isinstance(rid, bool)):
        raise ControlError("id: expected a string or an integer")
    if "v" not in obj:
        raise ControlError(f'v: missing protocol version (send "v": {PROTOCOL_VERSION})')
    if type(obj["v"]) is not int or obj["v"] != PROTOCOL_VERSION:
        raise ControlError(
            f"v: unsupported protocol version {obj['v']!r} (have {PROTOCOL_VERSION})"
        )
    op = obj.get("op")
    if not isinstance(op, str) or op not in _OP_KEYS:
        raise ControlError(f"op: expected one of {', '.join(_OP_KEYS)}, got {op!r}")
    extra = set(obj) - _COMMON_KEYS - _OP_KEYS[op]
    if extra:
        raise ControlError(f"{op}: unexpected field(s) {', '.join(sorted(extra))}")
    if op in ("get", "watch"):
        return Request(op, rid, None)
    device = obj.get("device")
    if not isinstance(device, str) or not device:
        raise ControlError(f"{op}: device: expected a device id such as gpu0")
    assert op in OPS
    change_op: Op = op
    if op == "health":
        health_s = obj.get("health")
        health_values = [h.value for h in Health]
        if health_s not in health_values:
            raise ControlError(f"health: health: expected one of {', '.join(health_values)}")
        health = Health(health_s)
        reason_s = obj.get("reason")
        reason_values = [r.value for r in Reason]
        if health is Health.HEALTHY:
            if reason_s is not None:
                raise ControlError("health: reason: a healthy device takes no reason")
            return Request(op, rid, Change("health", device, health=health))
        if reason_s not in reason_values:
            raise ControlError(f"health: reason: expected one of {', '.join(reason_values)}")
        return Request(op, rid, Change("health", device, health=health, reason=Reason(reason_s)))
    if op == "set-vfs":
        n = obj.get("num_vfs")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_VFS:
            raise ControlError(f"set-vfs: num_vfs: expected an integer 0..{MAX_VFS}")
        port = obj.get("port")
        if port is not None and (
            not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= MAX_PORT
        ):
            raise ControlError(f"set-vfs: port: expected an integer 0..{MAX_PORT}")
        return Request(op, rid, Change("set-vfs", device, num_vfs=n, port=port))
    return Request(op, rid, Change(change_op, device))


def decode_request(raw: bytes) -> object:
    """One request line -> JSON value, refusing what no client sends: nesting deeper than
    MAX_DEPTH, integers longer than MAX_DIGITS, NaN/Infinity, duplicate keys. Raises
    ControlError with the reason."""
    if _depth(raw) > MAX_DEPTH:
        raise ControlError(f"not a request: JSON nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(raw, parse_int=_parse_int, parse_constant=_no_constant,
                          object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ControlError(f"not a JSON line: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise ControlError(f"not a request: {exc}") from None


def _depth(raw: bytes) -> int:
    """The deepest nesting of [ and { outside strings (a cheap scan, no recursion)."""
    deepest = depth = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return deepest
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"integer with more than {MAX_DIGITS} digits")
    return int(text)


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _line(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


# -- server -------------------------------------------------------------------------------
@dataclass(eq=False)
class _Conn:
    """One client connection, for the connection bound: cancelled to evict it."""

    scope: trio.CancelScope
    last: float  # trio clock time of its last request or data
    busy: bool = False  # a request is being served: never evicted then
    watching: bool = False  # watchers stream events: they are bounded separately


def _raise_fd_limit() -> None:
    """Room for MAX_CONNECTIONS clients next to the FUSE server's own descriptors."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_CONNECTIONS + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


class ControlServer:
    """Serves the control API for one ``LiveTree``.

    ``on_diff`` is awaited after every committed change, before the reply: the FUSE layer
    invalidates kernel caches there, so a reader that starts after the reply sees the
    change. ``state_file`` (if set) is rewritten atomically after every change.
    """

    def __init__(
        self,
        live: LiveTree,
        *,
        on_diff: Callable[[Diff], Awaitable[None]],
        state_file: Path | None = None,
        info: Mapping[str, Any] | None = None,
    ) -> None:
        self._live = live
        self._on_diff = on_diff
        self._state_file = state_file
        self._info = dict(info or {})
        self._lock = trio.Lock()
        self._seq = 0
        self._watchers: set[trio.MemorySendChannel[dict[str, Any]]] = set()
        self._conns: set[_Conn] = set()

    async def run(
        self,
        socket_path: Path,
        nursery: trio.Nursery,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``socket_path`` (mode 0600) and serve connections in ``nursery``
        until cancelled; removes the socket on the way out."""
        _raise_fd_limit()
        listener = await _bind(socket_path)
        try:
            task_status.started()
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                                         errno.ENOMEM):
                        raise
                    # Out of descriptors: make room and go on serving, never stop.
                    log.warning("control accept: %s; dropping the longest idle connection",
                                exc.strerror)
                    self._evict_idle()
                    await trio.sleep(0.01)
                    continue
                if len(self._conns) >= MAX_CONNECTIONS:
                    self._evict_idle()
                nursery.start_soon(self._connection, stream, nursery)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket_path)
            with trio.CancelScope(shield=True):
                await listener.aclose()

    def _evict_idle(self) -> None:
        """Drop the connection that has been idle longest (never one mid-request)."""
        idle = [c for c in self._conns if not c.busy]
        if idle:
            victim = min(idle, key=lambda c: c.last)
            self._conns.discard(victim)
            victim.scope.cancel()

    async def _connection(self, stream: trio.SocketStream, nursery: trio.Nursery) -> None:
        buf = bytearray()
        conn = _Conn(trio.CancelScope(), trio.current_time())
        self._conns.add(conn)
        try:
            with conn.scope:
                while True:
                    nl = buf.find(b"\n")
                    if nl < 0 or nl > MAX_LINE:
                        if len(buf) > MAX_LINE:
                            await stream.send_all(
                                _line(_error(None, f"request longer than {MAX_LINE} bytes"))
                            )
                            return
                        chunk = await stream.receive_some(65536)
                        if not chunk:
                            return
                        conn.last = trio.current_time()
                        buf += chunk
                        continue
                    raw = bytes(buf[:nl])
                    del buf[: nl + 1]
                    if not raw.strip():
                        continue
                    conn.busy = True
                    reply, watch = await self._dispatch(raw)
                    if watch:
                        if sum(1 for c in self._conns if c.watching) >= MAX_WATCHERS:
                            await stream.send_all(_line(_error(
                                reply.get("id"), f"too many watchers (at most {MAX_WATCHERS})")))
                            return
                        conn.watching = True
                        await self._watch(stream, nursery, reply)
                        return
                    await stream.send_all(_line(reply))
                    conn.busy = False
                    conn.last = trio.current_time()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            self._conns.discard(conn)
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _dispatch(self, raw: bytes) -> tuple[dict[str, Any], bool]:
        try:
            obj = decode_request(raw)
        except ControlError as exc:
            return _error(None, str(exc)), False
        rid = obj.get("id") if isinstance(obj, dict) else None
        if isinstance(rid, bool) or not isinstance(rid, str | int | None):
            rid = None
        try:
            req = parse_request(obj)
            if req.op == "get":
                return self._get(req), False
            if req.op == "watch":
                return {"v": PROTOCOL_VERSION, "ok": True, "id": req.id, "op": "watch"}, True
            assert req.change is not None
            return await self._apply(req.id, req.change), False
        except ControlError as exc:
            return _error(rid, str(exc)), False
        except Exception as exc:  # a builder bug must not take the node down with it
            log.exception("control request failed: %r", raw[:200])
            return _error(rid, f"internal error: {type(exc).__name__}: {exc}"), False

    def _get(self, req: Request) -> dict[str, Any]:
        return {
            "v": PROTOCOL_VERSION,
            "ok": True,
            "id": req.id,
            "op": "get",
            "seq": self._seq,
            **self._info,
            "devices": describe(self._live.device_list()),
        }

    async def _apply(self, rid: str | int | None, change: Change) -> dict[str, Any]:
        # Shielded: once a change starts it is committed, invalidated and saved even if
        # the client goes away or the server is shutting down.
        with trio.CancelScope(shield=True):
            async with self._lock:
                t0 = time.perf_counter()
                pending = await trio.to_thread.run_sync(self._live.prepare, change)
                changed = pending is not None
                if pending is not None:
                    t1 = time.perf_counter()
                    diff = self._live.commit(pending)
                    t2 = time.perf_counter()
                    await self._on_diff(diff)
                    t3 = time.perf_counter()
                    if self._state_file is not None:
                        save_states(self._state_file, self._live.states)
                    self._seq += 1
                    log.debug(
                        "%s %s: prepare %.2f ms, commit %.2f ms, invalidate %.2f ms, save %.2f ms",
                        change.op,
                        change.device,
                        (t1 - t0) * 1e3,
                        (t2 - t1) * 1e3,
                        (t3 - t2) * 1e3,
                        (time.perf_counter() - t3) * 1e3,
                    )
                state = state_to_json(self._live.state(change.device))
                if changed:
                    self._broadcast(
                        {
                            "v": PROTOCOL_VERSION,
                            "event": "change",
                            "seq": self._seq,
                            "time": time.time(),
                            "op": change.op,
                            "device": change.device,
                            "state": state,
                        }
                    )
        return {
            "v": PROTOCOL_VERSION,
            "ok": True,
            "id": rid,
            "op": change.op,
            "device": change.device,
            "changed": changed,
            "seq": self._seq,
            "state": state,
        }

    def _broadcast(self, event: dict[str, Any]) -> None:
        for ch in list(self._watchers):
            try:
                ch.send_nowait(event)
            except trio.WouldBlock:
                log.warning("dropping a control watcher that fell %d events behind", WATCH_QUEUE)
                self._watchers.discard(ch)
                ch.close()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._watchers.discard(ch)

    async def _watch(
        self, stream: trio.SocketStream, nursery: trio.Nursery, reply: dict[str, Any]
    ) -> None:
        send, recv = trio.open_memory_channel[dict[str, Any]](WATCH_QUEUE)
        self._watchers.add(send)  # before the reply: no change can slip in between
        with trio.CancelScope() as scope:
            try:
                await stream.send_all(_line(reply))
                nursery.start_soon(_cancel_on_eof, stream, scope)
                async with recv:
                    async for event in recv:
                        await stream.send_all(_line(event))
                # The channel was closed under us: the watcher was too slow.
                await stream.send_all(
                    _line(_error(None, f"watch overflow: more than {WATCH_QUEUE} events behind"))
                )
            finally:
                self._watchers.discard(send)
                send.close()


async def _cancel_on_eof(stream: trio.SocketStream, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when the peer closes; anything it sends while watching is ignored.

    Ends on its own once the watch is over: the connection then closes the stream, which
    makes the pending receive raise ClosedResourceError."""
    try:
        while await stream.receive_some(4096):
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    scope.cancel()


def _error(rid: str | int | None, message: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "ok": False, "id": rid, "error": message}


async def _bind(path: Path) -> trio.SocketListener:
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise MountError(f"{path}: control socket path longer than {_SUN_PATH_MAX} bytes")
    probe = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await probe.connect(str(path))
    except FileNotFoundError:
        pass
    except OSError:
        os.unlink(path)  # left over from a server that died
    else:
        raise MountError(f"{path}: another server is listening on this control socket")
    finally:
        probe.close()
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # no window in which the socket is reachable by others
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(LISTEN_BACKLOG)
    return trio.SocketListener(sock)


# -- client -------------------------------------------------------------------------------
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
        return self.send_line(_line(request))

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
