"""Bringing a sandbox up as one transaction: its lock, its record, the runtime's steps,
and on failure (or an interrupt) the undo of everything made so far, unless ``retain``.

``sandbox up`` is this plus arguments and printing; a library user gets the same rollback.
The lock taken here (``base.StateLock``) is returned to the caller, who keeps it until it
exits: ``down`` (or another ``up``) of that name refuses meanwhile ("is coming up").
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path

from sandbox.errors import RuntimeBackendError, SandboxError
from sandbox.profile.spec import Cluster
from sandbox.progress import Progress
from sandbox.runtimes.base import STDIN_COPY, Runtime, StateBusy, StateLock
from sandbox.runtimes.record import STATE_MARKER, read_record
from sandbox.runtimes.steps import interrupts_held


class SandboxExists(SandboxError):
    """A sandbox of that name is there already: nothing to undo."""


def bring_up(runtime: Runtime, cluster: Cluster, profile_path: str, state_dir: Path,
             progress: Progress, *, retain: bool = False, stdin_text: str | None = None,
             settle: Callable[[], None] = lambda: None) -> StateLock | None:
    """Run ``runtime.up`` in ``state_dir`` under the sandbox's lock; returns the lock
    (hold it until the process exits). ``stdin_text``: the profile read from stdin, kept
    in the state dir (``profile_path`` names that copy) once the runtime is up. ``settle``
    is called once the outcome is known (up, or failed: before the clean-up), e.g. to
    ignore further SIGINTs so that neither the success nor the clean-up is interrupted.
    On failure everything made is removed (unless ``retain``) and a SandboxError naming
    the step is raised; KeyboardInterrupt and bugs (anything else) propagate as they
    are, after the same clean-up."""
    lock: StateLock | None = None
    try:
        with interrupts_held():  # the state dir made and locked, or neither
            lock = StateLock.acquire(state_dir, create=True, wait=2.0)
        if read_record(state_dir) is not None:
            raise SandboxExists(
                f"a sandbox named {state_dir.name!r} already exists ({state_dir}); run "
                f"`sandbox down --name {state_dir.name}` first or pick --name")
        runtime.up(cluster, profile_path, state_dir, progress)
        if stdin_text is not None:  # the state dir is the runtime's until now
            (state_dir / STDIN_COPY).write_text(stdin_text)
        settle()
        return lock
    except BaseException as exc:
        settle()
        if isinstance(exc, StateBusy):
            raise SandboxError(f"{exc}; wait until it has finished, or pick --name") from None
        if isinstance(exc, SandboxExists):
            raise
        if lock is None:  # nothing was made
            if isinstance(exc, OSError):
                raise SandboxError(f"sandbox up failed: {state_dir}: "
                                   f"{exc.strerror or exc}") from exc
            raise
        result = _failed(exc, runtime, state_dir, lock, retain, progress)
        if result is exc:
            raise
        raise result from exc


def _failed(exc: BaseException, runtime: Runtime, state_dir: Path, lock: StateLock,
            retain: bool, progress: Progress) -> BaseException:
    """Undo what the failed (or interrupted) ``up`` made, unless ``retain``; returns what
    to raise: KeyboardInterrupt again, else a SandboxError naming the step, or the
    original exception if it is a bug (anything but SandboxError and OSError)."""
    interrupted = isinstance(exc, KeyboardInterrupt)
    full = _full(exc, state_dir)  # before the clean-up frees space
    hint = ""
    if retain:
        print(f"keeping {state_dir} (--retain); clean up with `sandbox down --name "
              f"{state_dir.name}`", file=sys.stderr)
    elif not (state_dir / STATE_MARKER).is_file():
        # nothing of ours was created there: nothing to undo; the dir itself, if it was
        # made for this `up` (empty, then), goes
        if lock.created:
            with contextlib.suppress(OSError):
                state_dir.rmdir()
    else:
        hint = "; everything it made was removed (rerun with --retain to keep it)"
        progress("interrupted; cleaning up" if interrupted else "failed; cleaning up")
        try:
            runtime.down(state_dir, lambda _m: None)
        except (SandboxError, OSError) as cleanup:
            print(f"warning: cleanup incomplete: {cleanup}", file=sys.stderr)
    if interrupted:
        return exc
    if not isinstance(exc, SandboxError | OSError):
        return exc  # a bug: its traceback is wanted
    if full:
        hint = f" (the state root {state_dir.parent} is full){hint}"
    elif "(sun_path)" in str(exc):  # check_socket_path's words
        hint = (f"{hint}. The fix: a shorter state root, e.g. HWSANDBOX_STATE_DIR=/tmp/hws "
                f"(now {state_dir.parent}, {len(os.fsencode(state_dir.parent))} bytes)")
    if isinstance(exc, RuntimeBackendError):
        return SandboxError(f"sandbox up failed at step {exc.step!r}: {exc.message}{hint}")
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return SandboxError(f"sandbox up failed: {where}{exc.strerror or exc}{hint}")
    return SandboxError(f"sandbox up failed: {exc}{hint}")


def _full(exc: BaseException, state_dir: Path) -> bool:
    """Whether the state root ran out of space: a "No space left on device" in the chain
    of causes, or (a server that could not write its log died saying nothing) no free
    block left there now."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    try:
        return os.statvfs(state_dir.parent).f_bavail == 0
    except OSError:
        return False
