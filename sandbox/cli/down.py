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
from sandbox.runtimes.record import check_name, read_record
from sandbox.session import Session, find_session, list_sessions


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "down",
        help="stop a sandbox and remove its processes, mounts and state",
        description="Stop every process, unmount every fake tree (dead mounts included) and "
        "remove the sandbox's state directory. Nothing to remove (no such sandbox, or none "
        "running) is not an error: it says so and exits 0, so a CI teardown step can run "
        "it whatever happened before. While a `sandbox up` of the sandbox is still running, "
        "refuses (exit 1): the sandbox is coming up; run it again once that `up` has "
        "finished, or interrupt that `up` (Ctrl-C), which removes what it made.",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--name", help="which sandbox (default: the only one running)")
    which.add_argument("--all", action="store_true", help="every sandbox of the state root")
    p.set_defaults(func=run)


def _busy(name: str, exc: StateBusy) -> SandboxError:
    return SandboxError(f"{exc}; wait until it has finished and run `sandbox down --name "
                        f"{name}` again (Ctrl-C on that `sandbox up` removes everything it "
                        "made)")


def _nothing(why: str) -> int:
    print(f"{why}: nothing to remove", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.all:
        return _down_all()
    if args.name is not None:
        check_name(args.name)
        if not any(s.name == args.name for s in list_sessions()):
            # no record (yet): an `up` of that name may be making its state dir right now
            try:
                StateLock.check_free(state_dir_for(args.name))
            except StateBusy as exc:
                raise _busy(args.name, exc) from None
            return _nothing(f"no sandbox named {args.name!r}")
    elif not list_sessions():
        return _nothing("no sandbox is running")
    _down(find_session(args.name))
    return 0


def _down_all() -> int:
    sessions = list_sessions()
    if not sessions:
        return _nothing("no sandbox is running")
    failed = []
    for session in sessions:
        try:
            _down(session)
        except SandboxError as exc:
            print(f"error: {exc}", file=sys.stderr)
            failed.append(session.name)
    if failed:
        raise SandboxError(f"{len(failed)} of {len(sessions)} sandboxes not removed: "
                           + ", ".join(failed))
    return 0


def _down(session: Session) -> None:
    try:
        lock = StateLock.acquire(session.state_dir)
    except StateBusy as exc:
        raise _busy(session.name, exc) from None
    if lock is None or read_record(session.state_dir) is None:
        # the `up` that held it failed and removed everything before we got the lock
        _nothing(f"sandbox {session.name!r} was removed meanwhile")
        return
    runtime = runtime_for(session.runtime)

    def progress(message: str) -> None:
        print(f"  {message}", file=sys.stderr)

    try:
        runtime.down(session.state_dir, progress)
    finally:
        lock.release()
    print(f"sandbox {session.name!r} removed")
