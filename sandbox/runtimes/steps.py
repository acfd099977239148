"""Runtimes as ordered, named steps (the shape of kind's create actions).

Each step has a ``do`` (part of ``up``) and an ``undo`` (part of ``down``, and so of the
clean-up after a failed ``up``). ``run_steps`` runs the ``do``s in order; when one fails
it raises an error that names the step, and the caller undoes what was done: ``sandbox
up`` runs the runtime's ``down`` (unless ``--retain`` asks to keep it for debugging),
which is ``undo_steps`` over the same list: every ``undo`` in reverse, each one tolerant
of a step that never ran (it finds nothing to stop), problems collected rather than
stopping half-way.
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
