"""`sandbox fault` against a socket that is not a hw-sandbox control server.

A real unix socket server in a thread answers each request with a scripted reply (a
flood, the wrong JSON shape, deep nesting, not UTF-8...); the real CLI runs as a
subprocess. Each is one `error:` line and exit 1, never a traceback or a made-up result.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.paths import REPO

pytestmark = [pytest.mark.root]

STATE = {"health": "healthy", "reason": None, "plugged": True, "num_vfs": None}
FLOOD_CAP = 64 * 1024 * 1024  # the impostor stops flooding here, so nothing runs forever

Script = Callable[[socket.socket], None]


def _line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def _reply(**fields: object) -> bytes:
    """A reply to the CLI's `health n gpu0 healthy`, as a real server sends it, changed."""
    base: dict[str, object] = {"v": 1, "ok": True, "id": 1, "op": "health", "device": "gpu0",
                               "changed": True, "seq": 1, "state": STATE}
    base.update(fields)
    return _line({k: v for k, v in base.items() if v is not _DROP})


_DROP = object()


def _flood(conn: socket.socket) -> None:
    chunk = b"x" * 65536
    sent = 0
    with contextlib.suppress(OSError):  # the client gives up and closes: EPIPE
        while sent < FLOOD_CAP:
            conn.sendall(chunk)
            sent += len(chunk)


class Impostor:
    """Listens on ``path``; for each connection reads one request line, then sends
    ``script`` (bytes, or a function of the connection) and closes."""

    def __init__(self, path: Path, script: bytes | Script) -> None:
        self.path = path
        self.script = script
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(16)
        self.listener.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            with contextlib.suppress(OSError):
                conn.makefile("rb").readline(65536)
                if callable(self.script):
                    self.script(conn)
                else:
                    conn.sendall(self.script)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.listener.close()


@pytest.fixture
def impostor(tmp_path: Path) -> Iterator[Callable[[bytes | Script], Path]]:
    servers: list[Impostor] = []

    def start(script: bytes | Script) -> Path:
        srv = Impostor(tmp_path / f"s{len(servers)}.sock", script)
        servers.append(srv)
        return srv.path

    yield start
    for srv in servers:
        srv.close()


def _fault(sock: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`sandbox fault --socket SOCK ARGS`; a hang fails the test (timeout) instead."""
    return subprocess.run([sys.executable, "-m", "sandbox", "fault", "--socket", str(sock),
                           *args], cwd=REPO, text=True, capture_output=True, check=False,
                          timeout=90)


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    return lines[0]


DEEP = 100_000
CHANGE_REPLIES = {
    "flood without a newline": _flood,
    "an empty line": b"\n",
    "not JSON": b"HTTP/1.1 400 Bad Request\r\n",
    "a JSON array": b"[1, 2]\n",
    "a JSON string": b'"ok"\n',
    "null": b"null\n",
    "deeply nested arrays": b"[" * DEEP + b"]" * DEEP + b"\n",
    "deeply nested objects": b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"\n",
    "not UTF-8": b'{"v":1,"ok":false,"id":1,"error":"\xff"}\n',
    "UTF-16": json.dumps({"v": 1, "ok": False, "id": 1, "error": "x"}).encode("utf-16") + b"\n",
    "a huge integer": b'{"v":1,"ok":true,"id":1,"seq":' + b"9" * 5000 + b"}\n",
    "NaN": _reply(seq=float("nan")),
    "a duplicate key": b'{"v":1,"ok":true,"ok":false,"id":1,"error":"x"}\n',
    'only "ok"': b'{"ok": true}\n',
    "no version": _reply(v=_DROP),
    "another version": _reply(v=2),
    '"ok" not a boolean': _reply(ok="yes"),
    "an error that is not a string": b'{"v":1,"ok":false,"id":1,"error":{"a":1}}\n',
    "another request's id": _reply(id=99),
    "another device": _reply(device="gpu7"),
    "another op": _reply(op="unplug"),
    "no state": _reply(state=_DROP),
    "a state that is not an object": _reply(state="x"),
    "a state of unknown health": _reply(state={**STATE, "health": "fine"}),
    "a state without plugged": _reply(state={k: v for k, v in STATE.items() if k != "plugged"}),
    '"changed" not a boolean': _reply(changed="no"),
    "a lone surrogate": _reply(device="gpu0", state={**STATE, "reason": "\ud800"}),
}


@pytest.mark.parametrize("script", CHANGE_REPLIES.values(), ids=CHANGE_REPLIES.keys())
def test_a_change_against_an_impostor_is_one_error_line(
    impostor: Callable[[bytes | Script], Path], script: bytes | Script
) -> None:
    sock = impostor(script)
    line = _one_error_line(_fault(sock, "health", "n", "gpu0", "healthy"))
    assert line.startswith(f"error: {sock}: not a hw-sandbox control server ("), line
    assert line.endswith(")"), line


LIST_REPLIES = {
    "no devices": _line({"v": 1, "ok": True, "id": 1, "op": "get", "seq": 0}),
    "devices not a list": _line({"v": 1, "ok": True, "id": 1, "op": "get", "seq": 0,
                                 "devices": {"gpu0": {}}}),
    "a device that is not an object": _line({"v": 1, "ok": True, "id": 1, "op": "get",
                                             "seq": 0, "devices": [1]}),
    "a device without an id": _line({"v": 1, "ok": True, "id": 1, "op": "get", "seq": 0,
                                     "devices": [{"kind": "gpu", "state": STATE}]}),
    "a device without a state": _line({"v": 1, "ok": True, "id": 1, "op": "get", "seq": 0,
                                       "devices": [{"id": "gpu0", "kind": "gpu"}]}),
    "a NUMA node that is not a number": _line(
        {"v": 1, "ok": True, "id": 1, "op": "get", "seq": 0,
         "devices": [{"id": "gpu0", "kind": "gpu", "vendor": "v", "model": "m",
                      "pci_address": "0000:10:00.0", "numa_node": "zero", "dev_nodes": [],
                      "state": STATE}]}),
    # what `fault list` prints in its table must not carry terminal control sequences
    "a model with an escape sequence": _line(
        {"v": 1, "ok": True, "id": 1, "op": "get", "seq": 0,
         "devices": [{"id": "gpu0", "kind": "gpu", "vendor": "v", "model": "\x1b[2Jm",
                      "pci_address": "0000:10:00.0", "numa_node": 0, "dev_nodes": [],
                      "state": STATE}]}),
    "a device node with a newline": _line(
        {"v": 1, "ok": True, "id": 1, "op": "get", "seq": 0,
         "devices": [{"id": "gpu0", "kind": "gpu", "vendor": "v", "model": "m",
                      "pci_address": "0000:10:00.0", "numa_node": 0,
                      "dev_nodes": ["/dev/nvidia0\nok"], "state": STATE}]}),
}


@pytest.mark.parametrize("script", LIST_REPLIES.values(), ids=LIST_REPLIES.keys())
def test_a_list_against_an_impostor_is_one_error_line(
    impostor: Callable[[bytes | Script], Path], script: bytes
) -> None:
    sock = impostor(script)
    result = _fault(sock, "list")
    line = _one_error_line(result)
    assert line.startswith(f"error: {sock}: not a hw-sandbox control server ("), line
    assert result.stdout == ""


WATCH_OK = _line({"v": 1, "ok": True, "id": 1, "op": "watch"})


def _watch_then_flood(conn: socket.socket) -> None:
    conn.sendall(WATCH_OK)
    _flood(conn)


WATCH_EVENTS = {
    "deeply nested": b"[" * DEEP + b"]" * DEEP + b"\n",
    "not an event": _line({"v": 1, "surprise": 1}),
    "an array": b"[]\n",
    "flood without a newline": _watch_then_flood,
}


@pytest.mark.parametrize("event", WATCH_EVENTS.values(), ids=WATCH_EVENTS.keys())
def test_a_watch_against_an_impostor_is_one_error_line(
    impostor: Callable[[bytes | Script], Path], event: bytes | Script
) -> None:
    sock = impostor(event if callable(event) else WATCH_OK + event)
    result = _fault(sock, "watch", "n")
    line = _one_error_line(result)
    assert line.startswith(f"error: {sock}: not a hw-sandbox control server ("), line
    assert result.stdout == ""


def test_a_refusal_with_control_characters_is_one_clean_line(
    impostor: Callable[[bytes | Script], Path]
) -> None:
    sock = impostor(_line({"v": 1, "ok": False, "id": 1,
                           "error": "refused\nerror: fake second line\x1b[2J\u202e"}))
    line = _one_error_line(_fault(sock, "health", "n", "gpu0", "healthy"))
    assert line.startswith("error: health: refused"), line
    assert "\x1b" not in line, repr(line)
    assert "\u202e" not in line, repr(line)


def test_a_well_formed_reply_is_still_printed(impostor: Callable[[bytes | Script], Path]
                                               ) -> None:
    """The checks refuse impostors, not the real shape (here sent by the impostor)."""
    sock = impostor(_reply(state={**STATE, "health": "unhealthy", "reason": "aer-fatal"}))
    result = _fault(sock, "health", "n", "gpu0", "healthy")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "n/gpu0: unhealthy (aer-fatal) [done]\n"


@pytest.mark.parametrize("args", [("list",), ("health", "n", "gpu0", "healthy"), ("watch", "n")])
def test_a_socket_path_too_long_for_sun_path_says_so(tmp_path: Path, args: tuple[str, ...]
                                                    ) -> None:
    sock = tmp_path / ("x" * 120) / "control.sock"
    line = _one_error_line(_fault(sock, *args))
    assert str(sock) in line, line
    assert "107" in line, line
    assert "sun_path" in line, line
    assert "None" not in line, line
