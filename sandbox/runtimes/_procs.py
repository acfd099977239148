"""Watching and stopping the detached processes a runtime starts (by pid, not Popen)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def proc_start_time(pid: int) -> str | None:
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
    return start is not None and proc_start_time(pid) == start


def alive(pid: int, *, zombie: bool = False) -> bool:
    """Running; with ``zombie=True`` also an exited process nobody has reaped yet (its pid
    is still taken). A zombie child of ours is reaped first either way."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    if not zombie:
        return proc_start_time(pid) is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_pids(pids: list[int], timeout: float, kill_timeout: float | None = None,
              poll: float = 0.02, until_reaped: bool = False) -> bool:
    """SIGTERM all at once, SIGKILL what is left after ``timeout``, then wait for them
    (at most ``kill_timeout`` seconds, forever if None). ``until_reaped``: wait until the
    pids are gone entirely, not just exited. True when all are gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [p for p in pids if alive(p, zombie=until_reaped)]
        if not pids:
            return True
        time.sleep(poll)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + (kill_timeout if kill_timeout is not None else float("inf"))
    while any(alive(p, zombie=until_reaped) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True
