"""Runtimes as ordered, named steps (the shape of kind's create actions).

Each step has a ``do`` (part of ``up``) and an ``undo`` (part of ``down``, and so of the
clean-up after a failed ``up``). ``run_steps`` runs the ``do``s in order; when one fails
it raises an error that names the step, and the caller undoes what was done: ``sandbox
up`` runs the runtime's ``down`` (unless ``--retain`` asks to keep it for debugging),
which is ``undo_steps`` over the same list: every ``undo`` in reverse, each one tolerant
of a step that never ran (it finds nothing to stop), problems collected rather than
stopping half-way.

A SIGINT (``KeyboardInterrupt``) may come at any moment of a ``do``; the clean-up then
undoes what the record on disk names. So whatever must not be half done, a process
started *and* recorded, runs inside ``interrupts_held``: a SIGINT that arrives there is
raised as the block ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from sandbox.errors import RuntimeBackendError, SandboxError
from sandbox.progress import Progress
from sandbox.runtimes.base import remove_state_dir


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Step:
    name: str
    do: Callable[[], None] = _nothing
    undo: Callable[[], None] = _nothing


def run_steps(steps: Sequence[Step], progress: Progress) -> None:
    """Every ``do`` in order. A failure raises RuntimeBackendError naming the step (the
    original error is its cause; one that names its own step passes unchanged)."""
    for step in steps:
        try:
            step.do()
        except RuntimeBackendError:
            raise
        except SandboxError as exc:
            raise RuntimeBackendError(step.name, str(exc)) from exc
        except OSError as exc:
            raise RuntimeBackendError(step.name, f"{type(exc).__name__}: {exc}") from exc


def undo_steps(steps: Sequence[Step], progress: Progress) -> list[str]:
    """Every ``undo`` in reverse order; returns the problems (each named by its step)."""
    problems = []
    for step in reversed(steps):
        try:
            step.undo()
        except (SandboxError, OSError) as exc:
            problems.append(f"{step.name}: {exc}")
            progress(f"undoing {step.name}: {exc}")
    return problems


def take_down(state_dir: Path, steps: Sequence[Step], progress: Progress,
              leftovers: Callable[[], None] | None = None) -> None:
    """A backend's ``down``: every ``undo`` of its ``steps`` (then ``leftovers``, what
    the record may have missed), then the state dir removed; RuntimeBackendError naming
    the step ``down`` with every problem."""
    problems = undo_steps(steps, progress)
    if leftovers is not None:
        leftovers()
    if problems:
        raise RuntimeBackendError("down", "; ".join(problems))
    try:
        remove_state_dir(state_dir)
    except SandboxError as exc:
        raise RuntimeBackendError("down", str(exc)) from exc


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold SIGINT off for the block: one that arrives inside it raises KeyboardInterrupt
    as the block ends (after the block's own exception, if any, which becomes its
    context), so what the block does is done whole or not at all. Only where a SIGINT
    raises KeyboardInterrupt (the main thread, Python's own handler installed); elsewhere,
    and inside an outer block, it changes nothing."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        caught.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if caught:
            raise KeyboardInterrupt
