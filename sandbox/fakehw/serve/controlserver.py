"""The control API of a live node: a root-only unix socket speaking line-delimited JSON.

``ControlServer`` validates each request (``fakehw.control.protocol``), turns it into a
``Change`` for the ``LiveTree``, waits for the filesystem to invalidate what changed, saves
the states and tells watchers. It knows nothing of FUSE: ``on_diff`` is its only hook.
Its client is ``fakehw.control.ControlClient``.

The wire format is documented in docs/control-api.md.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from sandbox.errors import ControlError, MountError
from sandbox.fakehw import mig as migrule
from sandbox.fakehw.changes import Change
from sandbox.fakehw.control.protocol import (
    MAX_LINE,
    PROTOCOL_VERSION,
    Request,
    check_socket_path,
    decode_request,
    encode_line,
    error_reply,
    parse_request,
)
from sandbox.fakehw.serve.live import LiveTree
from sandbox.fakehw.serve.treediff import Diff
from sandbox.fakehw.states import describe, save_states, state_to_json

log = logging.getLogger(__name__)

WATCH_QUEUE = 1024
# Bounds that keep one hostile client from stopping the server or starving the others:
MAX_CONNECTIONS = 1024  # past this, the connection idle the longest is dropped
MAX_WATCHERS = 256
LISTEN_BACKLOG = 1024
GOODBYE_TIMEOUT = 1.0  # seconds to send a dropped watcher why, if it does not read
HANG_UP_DRAIN = 1.0  # seconds to read and drop what a refused client still sends
EMPTY_LINE = "empty request line (send one JSON object per line)"
WATCH_TAKES_NO_REQUESTS = ("a watching connection takes no requests: disconnected "
                           "(send requests on another connection)")


async def _hang_up(stream: trio.SocketStream) -> None:
    """End a connection whose client may still be sending (the rest of an oversized
    line): our side shut first, so its next read sees end of file, then what it sends
    read and dropped for up to HANG_UP_DRAIN seconds. Closed with unread bytes, a unix
    socket resets its peer instead: the client says "connection reset", not "closed"."""
    with trio.move_on_after(HANG_UP_DRAIN):
        await stream.send_eof()
        while await stream.receive_some(65536):
            pass


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
    ``get`` replies carry ``info`` and what ``status()`` returns at the time.
    """

    def __init__(
        self,
        live: LiveTree,
        *,
        on_diff: Callable[[Diff], Awaitable[None]],
        state_file: Path | None = None,
        info: Mapping[str, Any] | None = None,
        status: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self._live = live
        self._on_diff = on_diff
        self._state_file = state_file
        self._info = dict(info or {})
        self._status = status
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
                            too_long = f"request longer than {MAX_LINE} bytes"
                            await stream.send_all(encode_line(error_reply(None, too_long)))
                            await _hang_up(stream)
                            return
                        chunk = await stream.receive_some(65536)
                        if not chunk:
                            return
                        conn.last = trio.current_time()
                        buf += chunk
                        continue
                    raw = bytes(buf[:nl])
                    del buf[: nl + 1]
                    conn.busy = True
                    reply, watch = await self._dispatch(raw)
                    if watch:
                        if sum(1 for c in self._conns if c.watching) >= MAX_WATCHERS:
                            await stream.send_all(encode_line(error_reply(
                                reply.get("id"), f"too many watchers (at most {MAX_WATCHERS})")))
                            return
                        conn.watching = True
                        await self._watch(stream, nursery, reply, spoke=bool(buf))
                        return
                    await stream.send_all(encode_line(reply))
                    conn.busy = False
                    conn.last = trio.current_time()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            self._conns.discard(conn)
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _dispatch(self, raw: bytes) -> tuple[dict[str, Any], bool]:
        if not raw.strip():
            return error_reply(None, EMPTY_LINE), False
        try:
            obj = decode_request(raw)
        except ControlError as exc:
            return error_reply(None, str(exc)), False
        rid = obj.get("id") if isinstance(obj, dict) else None
        if isinstance(rid, bool) or not isinstance(rid, str | int | None):
            rid = None
        try:
            req = parse_request(obj)
            served = self._info.get("node")
            if req.node is not None and served is not None and req.node != served:
                raise ControlError(f"{req.op}: node: this server serves node {served!r}, "
                                   f"not {req.node!r}")
            if req.op == "get":
                return self._get(req), False
            if req.op == "watch":
                return {"v": PROTOCOL_VERSION, "ok": True, "id": req.id, "op": "watch"}, True
            assert req.change is not None
            return await self._apply(req.id, req.change), False
        except ControlError as exc:
            return error_reply(rid, str(exc), exc.code), False
        except Exception as exc:  # a builder bug must not take the node down with it
            log.exception("control request failed: %r", raw[:200])
            return error_reply(rid, f"internal error: {type(exc).__name__}: {exc}"), False

    def _get(self, req: Request) -> dict[str, Any]:
        return {
            "v": PROTOCOL_VERSION,
            "ok": True,
            "id": req.id,
            "op": "get",
            "seq": self._seq,
            **self._info,
            **(self._status() if self._status is not None else {}),
            "devices": describe(self._live.device_list()),
        }

    async def _apply(self, rid: str | int | None, change: Change) -> dict[str, Any]:
        # Shielded: once a change starts it is committed, invalidated and saved even if
        # the client goes away or the server is shutting down.
        with trio.CancelScope(shield=True):
            async with self._lock:
                t0 = time.perf_counter()
                before = self._live.state(change.device)
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
        reply = {
            "v": PROTOCOL_VERSION,
            "ok": True,
            "id": rid,
            "op": change.op,
            "device": change.device,
            "changed": changed,
            "seq": self._seq,
            "state": state,
        }
        if change.op == "gi-create":  # the id NVML hands back
            reply["gi"] = migrule.created(self._live.records[change.device].mig, before,
                                          self._live.state(change.device))
        elif change.op == "ci-create":
            reply["ci"] = 0
        return reply

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
        self, stream: trio.SocketStream, nursery: trio.Nursery, reply: dict[str, Any], *,
        spoke: bool,
    ) -> None:
        """Stream events until the watcher closes, falls WATCH_QUEUE events behind or sends
        anything (``spoke``: it sent more after its watch request); then return."""
        send, recv = trio.open_memory_channel[dict[str, Any]](WATCH_QUEUE)
        self._watchers.add(send)  # before the reply: no change can slip in between
        heard = trio.Event()
        mid_line = False  # a line is being sent (or the last one was sent): no goodbye
        with trio.CancelScope() as scope:
            try:
                await stream.send_all(encode_line(reply))
                if spoke:
                    heard.set()
                else:
                    nursery.start_soon(_end_on_eof_or_data, stream, scope, heard)
                    async with recv:
                        async for event in recv:
                            mid_line = True
                            await stream.send_all(encode_line(event))
                            mid_line = False
                    # The channel was closed under us: the watcher was too slow.
                    overflow = f"watch overflow: more than {WATCH_QUEUE} events behind"
                    mid_line = True
                    await stream.send_all(encode_line(error_reply(None, overflow)))
            finally:
                self._watchers.discard(send)
                send.close()
        if heard.is_set() and not mid_line:
            with trio.move_on_after(GOODBYE_TIMEOUT):
                await stream.send_all(encode_line(error_reply(None, WATCH_TAKES_NO_REQUESTS)))


async def _end_on_eof_or_data(
    stream: trio.SocketStream, scope: trio.CancelScope, heard: trio.Event
) -> None:
    """Cancel ``scope`` when the peer closes or sends anything (then ``heard`` is set): a
    watching connection takes no requests, and is not read from forever.

    Ends on its own once the watch is over: the connection then closes the stream, which
    makes the pending receive raise ClosedResourceError."""
    try:
        if await stream.receive_some(4096):
            heard.set()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    scope.cancel()


async def _bind(path: Path) -> trio.SocketListener:
    check_socket_path(path, MountError)
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


