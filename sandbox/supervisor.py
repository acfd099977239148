"""The one way the sandbox starts, watches and stops its long-running processes.

Every server a runtime starts (a node's FUSE server, the kubelet harness, plugins,
etcd, the API server, containerd, a kubelet...) goes through ``spawn``: detached (a
throwaway ``sh`` forks it into its own session and exits, so it outlives the CLI and is
never a child of ours to reap), stdin from /dev/null, stdout and stderr appended to one
log file. A process is known by its ``Proc``: name, pid, *start time* and log. The start
time (``/proc/PID/stat`` field 22) is what tells it from a later process that reuses the
pid: nothing here signals a pid whose start time has changed.

Readiness has one protocol: a server prints ``ready_line(...)`` on stdout (flushed) once
it serves: ``ready`` and what reaching it takes (a node server: ``ready SOCKET PID``; the
kubelet harness: ``ready``); ``wait_ready`` finds it in the log, after where the log ended
when the process was spawned, and returns its fields (``parse_ready``), or fails at once,
with the log's tail, if the process exits first.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from sandbox.errors import MountError, SpawnError

READY = b"ready"
# Forks "$@" into a new session (setsid execs it: the background child of `sh -c` is not
# a group leader) with its output appended to the log, prints its pid, exits.
_LAUNCH = 'log=$1; shift; setsid "$@" </dev/null >>"$log" 2>&1 & echo $!'


def ready_line(*fields: object) -> str:
    """The line a server prints once it serves: ``ready`` and ``fields``, space-separated."""
    return " ".join([READY.decode(), *(str(f) for f in fields)])


def parse_ready(line: bytes) -> list[str]:
    """The fields of a ready line (``ready_line``'s), split at spaces; SpawnError if it
    is not one."""
    words = line.decode(errors="replace").split(" ")
    if words[0] != READY.decode():
        raise SpawnError(f"not a ready line: {line!r}")
    return words[1:]


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks, /proc/PID/stat field 22); None when it is
    gone or a zombie. Comparing it tells a process from a later one reusing its pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return fields[19]  # starttime: field 22 of stat, 20th after the comm


def same_process(pid: int, start: str | None) -> bool:
    """``pid`` is still the process that had start time ``start`` (not a later one that
    reuses its number); False when it is gone or nothing was recorded."""
    return start is not None and start_time(pid) == start


@dataclass(frozen=True)
class Proc:
    """A process we started: its pid and start time identify it; its log explains it."""

    name: str
    pid: int
    start: str
    log: Path
    log_offset: int = 0  # where the log ended when it was spawned (its ready line is after)

    def running(self) -> bool:
        return same_process(self.pid, self.start)

    def signal(self, sig: int) -> bool:
        """Send ``sig`` if this is still the process we started; False if it is gone."""
        if not self.running():
            return False
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "pid": self.pid, "start": self.start, "log": str(self.log)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Proc:
        return cls(str(obj["name"]), int(obj["pid"]), str(obj["start"]), Path(obj["log"]))

    def save(self, path: Path) -> None:
        """Record it in ``path`` (a pid file of ours: JSON), atomically."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_json()) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Proc | None:
        """The process recorded in ``path``; None when there is no (readable) record."""
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def spawn(name: str, argv: Sequence[str], log: Path, *,
          env: Mapping[str, str] | None = None) -> Proc:
    """Start ``argv`` detached, its output appended to ``log``; returns at once."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as fh:
        fh.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {name}: {' '.join(argv)}\n")
        offset = fh.tell()
    try:
        out = subprocess.run(["sh", "-c", _LAUNCH, "sh", str(log), *argv],
                             capture_output=True, text=True, check=False,
                             start_new_session=True, env=None if env is None else dict(env))
    except OSError as exc:
        raise SpawnError(f"{name}: cannot start: {exc}") from exc
    if out.returncode != 0 or not out.stdout.strip().isdigit():
        raise SpawnError(f"{name}: cannot start: {(out.stdout + out.stderr).strip()}")
    pid = int(out.stdout.strip())
    started = start_time(pid)
    if started is None:
        raise SpawnError(f"{name} exited at once: {log_tail(log)}")
    return Proc(name, pid, started, log, offset)


def find_line(proc: Proc, prefix: bytes = READY, anywhere: bool = False) -> bytes | None:
    """The first whole line starting with ``prefix`` (``anywhere``: holding it, as after
    a logger's time stamp) that ``proc`` wrote to its log after ``proc.log_offset``, if
    any."""
    try:
        with proc.log.open("rb") as fh:
            fh.seek(proc.log_offset)
            for line in fh:
                found = prefix in line if anywhere else line.startswith(prefix)
                if found and line.endswith(b"\n"):
                    return line.rstrip(b"\n")
    except OSError:
        return None
    return None


def wait_line(proc: Proc, prefix: bytes, timeout: float) -> bytes:
    """Until ``proc`` writes a line starting with ``prefix``; returns it. SpawnError (with
    the log's tail) when it exits first or says nothing within ``timeout``."""
    deadline = time.monotonic() + timeout
    what = prefix.decode(errors="replace")
    while True:
        line = find_line(proc, prefix)
        if line is not None:
            return line
        if not proc.running():
            line = find_line(proc, prefix)  # it may have written it and exited since
            if line is not None:
                return line
            raise SpawnError(f"{proc.name} exited before it said {what!r}: "
                             f"{log_tail(proc.log)}")
        if time.monotonic() > deadline:
            raise SpawnError(f"{proc.name} did not say {what!r} within {timeout:.0f}s: "
                             f"{log_tail(proc.log)}")
        time.sleep(0.01)


def wait_ready(proc: Proc, timeout: float = 20.0) -> list[str]:
    """Until ``proc`` prints its ready line; returns its fields (``parse_ready``).
    SpawnError when it exits first or is not ready within ``timeout`` (it is then stopped:
    a server that is not ready is of no use to anyone)."""
    try:
        return parse_ready(wait_line(proc, READY, timeout))
    except SpawnError:
        stop([proc], timeout=2.0)
        raise


def wait_until(proc: Proc, what: str, check: Any, timeout: float,
               poll: float = 0.3) -> None:
    """Poll ``check()`` until true; SpawnError (with the log's tail) at once if ``proc``
    dies, or after ``timeout``. Errors raised by ``check`` count as false."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            if check():
                return
        if not proc.running():
            raise SpawnError(f"{proc.name} exited before {what}; log {proc.log}:\n"
                             + log_tail(proc.log, 15, joined="\n"))
        if time.monotonic() > deadline:
            raise SpawnError(f"{proc.name} not {what} after {timeout:.0f}s; log {proc.log}:\n"
                             + log_tail(proc.log, 15, joined="\n"))
        time.sleep(poll)


def stop(procs: Iterable[Proc], timeout: float = 5.0, kill_timeout: float = 5.0,
         poll: float = 0.02) -> bool:
    """SIGTERM each process that is still ours, SIGKILL what is left after ``timeout``,
    then wait up to ``kill_timeout``. True when all are gone."""
    left = [p for p in procs if p.signal(signal.SIGTERM)]
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        _reap(left)
        left = [p for p in left if p.running()]
        if left:
            time.sleep(poll)
    for p in left:
        p.signal(signal.SIGKILL)
    deadline = time.monotonic() + kill_timeout
    while left and time.monotonic() < deadline:
        _reap(left)
        left = [p for p in left if p.running()]
        if left:
            time.sleep(poll)
    return not left


def _reap(procs: Iterable[Proc]) -> None:
    """Reap any of them that happen to be our children (a process that spawned its own
    parent's siblings, e.g. a test calling a runtime, would otherwise keep zombies)."""
    for p in procs:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(p.pid, os.WNOHANG)


def log_tail(log: Path, lines: int = 5, *, joined: str = " | ") -> str:
    """The last lines of a log for an error message: its ``error:`` lines when it has some
    (a traceback's frames say nothing to a user), else its last lines."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "no output"
    all_lines = [ln for ln in text.strip().splitlines() if not ln.startswith("--- ")]
    errors = [ln for ln in all_lines if ln.startswith("error: ")]
    return joined.join((errors or all_lines)[-lines:]) or "no output"


_holding: list[bool] = []  # inside a signals_held block (of the main thread)


@contextlib.contextmanager
def signals_held(signums: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold ``signums`` off for the block (a clean-up that must run whole: stop what was
    started, unmount what was mounted): one that arrives meanwhile is raised again once
    the block has ended and the handlers are back (SIGINT: KeyboardInterrupt; a SIGTERM
    without a handler: the process ends then). In the main thread only, where Python's
    handlers run; elsewhere, and inside an outer block, it changes nothing."""
    if threading.current_thread() is not threading.main_thread() or _holding:
        yield
        return
    caught: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        caught.append(signum)

    previous = {s: signal.signal(s, hold) for s in signums}
    _holding.append(True)
    try:
        yield
    finally:
        _holding.pop()
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the block, as Ctrl-C does, so that clean-ups
    run (a CI job's timeout sends SIGTERM). Main thread only, where Python's handlers
    run; elsewhere it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def unmount_fuse(root: Path) -> None:
    """Unmount a FUSE mount (lazily when busy). MountError when neither works."""
    problems = []
    for argv in (["fusermount3", "-u", str(root)], ["fusermount3", "-uz", str(root)]):
        try:
            out = subprocess.run(argv, capture_output=True, text=True, check=False)
        except FileNotFoundError as exc:
            raise MountError("fusermount3 not found (apt-get install fuse3)") from exc
        if out.returncode == 0 or not os.path.ismount(root):
            return
        problems.append(out.stderr.strip())
    raise MountError(f"{root}: cannot unmount: {problems[-1]}")


class Child:
    """A process that stays our child (a tool under test whose exit code matters, e.g.
    a third-party device plugin graded by ``sandbox kubelet check``); output to ``log``.

    ``group``: it leads a session of its own, so a terminal's Ctrl-C reaches only us (we
    stop it, in order), and ``stop`` signals its whole process group: what it forked and
    left running goes with it."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, *,
                 env: Mapping[str, str] | None = None, group: bool = False) -> None:
        self.name, self.log, self.group = name, log, group
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            try:
                self._popen = subprocess.Popen(
                    list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    env=None if env is None else dict(env), start_new_session=group)
            except OSError as exc:
                raise SpawnError(f"{name}: cannot start: {exc}") from exc
        self.pid = self._popen.pid

    @property
    def returncode(self) -> int | None:
        """None while it runs; its exit code (negative: killed by that signal) after."""
        return self._popen.poll()

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, SIGKILL after ``timeout``; reaped. Returns the exit code. With
        ``group``, the same signals go to its process group, and what is left of the group
        once it is gone is killed (the group's id stays taken while any member lives, so
        it names no one else)."""
        if self._popen.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
        code = self._popen.wait()
        if self.group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        return code

    def _signal(self, sig: int) -> None:
        if self.group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
        else:
            self._popen.send_signal(sig)
