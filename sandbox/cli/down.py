"""`sandbox down`: remove a sandbox and everything it made.

It takes the sandbox's lock (``base.StateLock``) first: while a ``sandbox up`` of the
sandbox is still running (bringing it up, or cleaning up after its failure) the lock is
that ``up``'s, and ``down`` refuses (exit 1: "is coming up") instead of removing what is
still being made; once that ``up`` has exited, ``down`` removes the sandbox as usual.
"""

from __future__ import annotations

import argparse
import sys

from sandbox.errors import SandboxError
from sandbox.runtimes import runtime_for
from sandbox.runtimes.base import StateBusy, StateLock, state_dir_for
from sandbox.runtimes.record import read_record
from sandbox.session import find_session


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "down",
        help="stop a sandbox and remove its processes, mounts and state",
        description="Stop every process, unmount every fake tree (dead mounts included) and "
        "remove the sandbox's state directory. While a `sandbox up` of the sandbox is "
        "still running, refuses (exit 1): the sandbox is coming up; run it again once that "
        "`up` has finished, or interrupt that `up` (Ctrl-C), which removes what it made.",
    )
    p.add_argument("--name", help="which sandbox (default: the only one running)")
    p.set_defaults(func=run)


def _busy(name: str, exc: StateBusy) -> SandboxError:
    return SandboxError(f"{exc}; wait until it has finished and run `sandbox down --name "
                        f"{name}` again (Ctrl-C on that `sandbox up` removes everything it "
                        "made)")


def run(args: argparse.Namespace) -> int:
    try:
        session = find_session(args.name)
    except SandboxError:
        # no record (yet): an `up` of that name may be making its state dir right now
        if args.name is not None:
            try:
                StateLock.check_free(state_dir_for(args.name))
            except StateBusy as exc:
                raise _busy(args.name, exc) from None
        raise
    try:
        lock = StateLock.acquire(session.state_dir)
    except StateBusy as exc:
        raise _busy(session.name, exc) from None
    if lock is None or read_record(session.state_dir) is None:
        # the `up` that held it failed and removed everything before we got the lock
        raise SandboxError(f"no sandbox named {session.name!r} (it was removed meanwhile)")
    runtime = runtime_for(session.runtime)

    def progress(message: str) -> None:
        print(f"  {message}", file=sys.stderr)

    try:
        runtime.down(session.state_dir, progress)
    finally:
        lock.release()
    print(f"sandbox {session.name!r} removed")
    return 0
