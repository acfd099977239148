"""When to rescan, and what: every ``interval`` seconds, or on a live tree's change events.

A full rescan reads every device's files; at 1,000 GPUs a rescan every second kept the
plugin (and the FUSE server answering it) busy while nothing changed. A sandbox's live tree
publishes every committed change on its control socket (``{"op": "watch"}``, one JSON line
per change, sent after the new tree is live and the kernel's caches are dropped). With
``socket`` given, ``Rescans`` follows that stream: a change makes a rescan due at once, of
only the PCI function the event names (its address from one ``get`` when the watch
starts; an unknown device means a full rescan), and while the stream is up the full rescan
slows to every ``resync`` seconds (a safety net, not the way changes arrive). When the
socket is absent, refuses the watch or drops it, the period is ``interval`` again and a
full rescan is due at once; it reconnects every ``interval`` seconds.

The socket only says *when* to look and *where*: device facts still come from ``/sys``
and ``/dev`` alone (``hwplugins.devices``), exactly as without a socket.
"""

from __future__ import annotations

import json
import logging
import socket as so
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("hwplugins.watch")

MAX_LINE = 65536  # the control protocol's line limit


@dataclass(frozen=True)
class Rescan:
    """One rescan to run: ``dirty`` the PCI addresses to re-read, None for all of them."""

    dirty: frozenset[str] | None


class Rescans:
    """Tells a rescan loop when a rescan is due. ``close()`` stops the watcher thread."""

    def __init__(self, interval: float, socket: Path | None = None,
                 resync: float = 30.0) -> None:  # fmt: skip
        self.interval = interval
        self.resync = max(resync, interval)
        self.socket = socket
        self.events = 0  # change events seen (for logs and tests)
        self._changed = threading.Event()
        self._lock = threading.Lock()
        self._full = True  # the first rescan reads everything
        self._dirty: set[str] = set()
        self._connected = False
        self._closing = threading.Event()
        self._conn: so.socket | None = None
        self._next = time.monotonic()
        self._thread: threading.Thread | None = None
        if socket is not None:
            self._thread = threading.Thread(target=self._follow, name="rescan-watch",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    @property
    def watching(self) -> bool:
        return self._connected

    def due(self, now: float) -> Rescan | None:
        """The rescan to run now, if one is due; the caller then runs it at once."""
        with self._lock:
            full = self._full or now >= self._next
            if not full and not self._changed.is_set():
                return None
            dirty = None if full else frozenset(self._dirty)
            self._full = False
            self._dirty.clear()
            self._changed.clear()
            if full:
                self._next = now + (self.resync if self._connected else self.interval)
        return Rescan(dirty)

    def retry(self, now: float) -> None:
        """Make a full rescan due within ``interval`` (after a failed publish, say)."""
        with self._lock:
            self._next = min(self._next, now + self.interval)

    def wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds, less when a change event arrives."""
        self._changed.wait(timeout)

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.shutdown(so.SHUT_RDWR)
                except OSError:
                    pass
        if self._thread is not None:
            self._thread.join(5)

    def _mark(self, address: str | None) -> None:
        with self._lock:
            if address is None:
                self._full = True
            else:
                self._dirty.add(address)
        self._changed.set()

    # -- the watcher thread ---------------------------------------------------------------
    def _follow(self) -> None:
        assert self.socket is not None
        warned = False
        while not self._closing.is_set():
            reason = self._stream(self.socket)
            if self._connected:
                log.warning("watch on %s ended (%s); rescanning every %.2fs", self.socket,
                            reason, self.interval)  # fmt: skip
                with self._lock:
                    self._connected = False
                    self._next = min(self._next, time.monotonic() + self.interval)
                self._mark(None)  # a change may have slipped in: look now
            elif not warned:
                log.info("no watch on %s (%s); rescanning every %.2fs", self.socket, reason,
                         self.interval)  # fmt: skip
                warned = True
            self._closing.wait(self.interval)

    def _connect(self, path: Path) -> so.socket:
        conn = so.socket(so.AF_UNIX, so.SOCK_STREAM)
        with self._lock:
            if self._closing.is_set():
                conn.close()
                raise OSError("closing")
            self._conn = conn
        conn.settimeout(5.0)
        conn.connect(str(path))
        return conn

    def _addresses(self, path: Path) -> dict[str, str]:
        """Device id -> PCI address, from one ``get`` on its own connection."""
        conn = self._connect(path)
        try:
            conn.sendall(b'{"v":1,"op":"get","id":1}\n')
            reply = _parse(conn.makefile("rb").readline(1024 * MAX_LINE))  # every device
        finally:
            conn.close()
        devices = reply.get("devices")
        if reply.get("ok") is not True or not isinstance(devices, list):
            return {}
        return {str(d["id"]): str(d["pci_address"]) for d in devices
                if isinstance(d, dict) and "id" in d and "pci_address" in d}  # fmt: skip

    def _stream(self, path: Path) -> str:
        """Follow one watch connection until it ends; why it ended."""
        try:
            addresses = self._addresses(path)
            conn = self._connect(path)
        except OSError as exc:
            return exc.strerror or str(exc)
        try:
            conn.sendall(b'{"v":1,"op":"watch"}\n')
            reader = conn.makefile("rb")
            first = _parse(reader.readline(MAX_LINE))
            if first.get("ok") is not True:
                return f"refused: {first.get('error', first)}"
            conn.settimeout(None)
            with self._lock:
                self._connected = True
                self._next = time.monotonic() + self.resync
            self._mark(None)  # anything that changed before the watch began
            log.info("following change events on %s (%d devices); full rescan every %.0fs "
                     "otherwise", path, len(addresses), self.resync)  # fmt: skip
            while True:
                event = _parse(reader.readline(MAX_LINE))
                if not event:
                    return "closed"
                if event.get("ok") is False:
                    return str(event.get("error"))
                if event.get("event") == "change":
                    self.events += 1
                    self._mark(addresses.get(str(event.get("device"))))
        except OSError as exc:
            return exc.strerror or str(exc)
        finally:
            with self._lock:
                self._conn = None
            conn.close()


def _parse(line: bytes) -> dict[str, Any]:
    if not line:
        return {}
    try:
        value = json.loads(line)
    except ValueError:
        return {"ok": False, "error": "not JSON"}
    return value if isinstance(value, dict) else {"ok": False, "error": "not an object"}
