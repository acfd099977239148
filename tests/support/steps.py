"""The slow steps of an end-to-end run, listed at its end.

pytest's ``--durations`` names the slow tests; an end-to-end test's time is mostly one or
two of its steps (a cluster coming up, a wait for a pod, a kubectl call), and which one
moves from run to run. The e2e fixtures record each such step here with the test it ran
in; ``tests/conftest.py`` prints the slowest at the end of the run, beside the durations
(a pod's DRA claim that waited ~80 s for a kubelet retry was found this way, in one run).
Steps recorded in a pytest-xdist worker stay in that worker (the e2e envs run in one
process).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

LISTED = 20  # the slowest this many steps are printed


@dataclass(frozen=True)
class Step:
    test: str
    what: str
    seconds: float


class _Reporter(Protocol):
    def write_sep(self, sep: str, title: str) -> None: ...
    def write_line(self, line: str) -> None: ...


class StepLog:
    """Steps of at least ``from_seconds`` (most kubectl calls take ~0.1 s: not kept)."""

    def __init__(self, from_seconds: float = 1.0) -> None:
        self.from_seconds = from_seconds
        self.steps: list[Step] = []

    def record(self, what: str, seconds: float) -> None:
        """One step of the running test (or of a fixture's setup: its test is named)."""
        if seconds < self.from_seconds:
            return
        # "tests/e2e/test_native.py::test_pods (call)" -> "test_native.py::test_pods"
        test = os.environ.get("PYTEST_CURRENT_TEST", "(outside a test)").rsplit(" (", 1)[0]
        self.steps.append(Step(test.rsplit("/", 1)[-1], what, seconds))

    @contextlib.contextmanager
    def timed(self, what: str) -> Iterator[None]:
        """Record the block as a step, also when it fails (a timeout is the slowest step)."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.record(what, time.monotonic() - start)

    def report(self, terminal: _Reporter) -> None:
        """The slowest recorded steps, longest first, and what all of them took together."""
        if not self.steps:
            return
        slowest = sorted(self.steps, key=lambda s: -s.seconds)[:LISTED]
        total = sum(s.seconds for s in self.steps)
        terminal.write_sep("=", f"slowest {len(slowest)} of {len(self.steps)} steps over "
                                f"{self.from_seconds:g} s ({total:.0f} s in all)")
        for step in slowest:
            terminal.write_line(f"{step.seconds:7.1f}s {step.test}: {step.what}")


# the run's log: what the e2e fixtures record, what tests/conftest.py reports
LOG = StepLog()
timed = LOG.timed
