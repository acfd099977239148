"""The e2e envs' list of slow steps (tests/support/steps.py): what it keeps and prints."""

from __future__ import annotations

import pytest

from tests.support.steps import LISTED, StepLog


class Terminal:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def write_sep(self, sep: str, title: str) -> None:
        self.lines.append(f"{sep * 3} {title} {sep * 3}")

    def write_line(self, line: str) -> None:
        self.lines.append(line)


def test_slowest_first_with_the_test_that_took_them() -> None:
    log = StepLog(from_seconds=1.0)
    log.record("kubectl get nodes", 0.2)  # a quick call: not kept
    log.record("wait for the pod with the claim runs", 73.3)
    log.record("up 8gpu-2numa.yaml", 14.0)
    terminal = Terminal()
    log.report(terminal)
    assert terminal.lines == [
        "=== slowest 2 of 2 steps over 1 s (87 s in all) ===",
        "   73.3s test_step_log.py::test_slowest_first_with_the_test_that_took_them: "
        "wait for the pod with the claim runs",
        "   14.0s test_step_log.py::test_slowest_first_with_the_test_that_took_them: "
        "up 8gpu-2numa.yaml",
    ]


def test_a_failed_step_is_kept_and_the_list_is_bounded() -> None:
    log = StepLog(from_seconds=0.0)
    with pytest.raises(AssertionError), log.timed("wait for something that never comes"):
        raise AssertionError("timed out")
    assert [s.what for s in log.steps] == ["wait for something that never comes"]
    for n in range(LISTED + 5):
        log.record(f"step {n}", float(n))
    terminal = Terminal()
    log.report(terminal)
    assert terminal.lines[0].startswith(f"=== slowest {LISTED} of {LISTED + 6} steps")
    assert len(terminal.lines) == 1 + LISTED
    assert terminal.lines[1].endswith(f": step {LISTED + 4}")


def test_nothing_recorded_prints_nothing() -> None:
    terminal = Terminal()
    StepLog().report(terminal)
    assert terminal.lines == []
