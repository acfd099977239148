"""Runtimes as ordered, named steps (the shape of kind's create actions).

Each step has a ``do`` (part of ``up``) and an ``undo`` (part of ``down`` and of the
clean-up after a failed ``up``). ``run_steps`` runs the ``do``s in order; when one fails
it runs the ``undo``s of the steps already done, in reverse, and raises an error that
names the failed step. ``undo_steps`` is ``down``: every ``undo`` in reverse, each one
tolerant of a step that never ran (it finds nothing to stop), problems collected rather
than stopping half-way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sandbox.errors import RuntimeBackendError, SandboxError
from sandbox.runtimes.base import Progress


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Step:
    name: str
    do: Callable[[], None] = _nothing
    undo: Callable[[], None] = _nothing


def run_steps(steps: Sequence[Step], progress: Progress) -> None:
    """Every ``do`` in order. On failure: the ``undo``s of the done steps in reverse,
    then RuntimeBackendError naming the step (the original error is its cause)."""
    done: list[Step] = []
    for step in steps:
        try:
            step.do()
        except BaseException as exc:
            progress(f"{step.name} failed; undoing {len(done)} step(s) done before it")
            undo_steps(done, progress)
            if isinstance(exc, RuntimeBackendError) or not isinstance(exc, Exception):
                raise
            raise RuntimeBackendError(step.name, str(exc)) from exc
        done.append(step)


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
