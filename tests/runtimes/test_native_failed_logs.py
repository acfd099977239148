"""A failed native start keeps a copy of its logs beside the state dir, marked as ours:
the copy is replaced by the next failed start, a foreign directory of that name never."""

from __future__ import annotations

import os
from pathlib import Path

from sandbox.runtimes.native import FAILED_LOGS_MARKER, Layout, NativeRuntime


def _failed_start(state: Path, log: str) -> list[str]:
    (state / "logs").mkdir(parents=True, exist_ok=True)
    (state / "logs" / "kubelet.log").write_text(log)
    said: list[str] = []
    NativeRuntime()._save_logs(Layout(state), said.append)
    return said


def test_the_copy_is_marked_and_replaced_by_the_next_failed_start(tmp_path: Path) -> None:
    state = tmp_path / "sb"
    keep = tmp_path / "sb.failed-logs"
    assert _failed_start(state, "first\n") == [f"logs of the failed start: {keep}"]
    assert (keep / FAILED_LOGS_MARKER).is_file()
    assert (keep / "kubelet.log").read_text() == "first\n"
    (keep / "stale.log").write_text("from the first start\n")
    assert _failed_start(state, "second\n") == [f"logs of the failed start: {keep}"]
    assert sorted(os.listdir(keep)) == [FAILED_LOGS_MARKER, "kubelet.log"]
    assert (keep / "kubelet.log").read_text() == "second\n"


def test_a_foreign_directory_or_link_of_that_name_is_left_alone(tmp_path: Path) -> None:
    state = tmp_path / "sb"
    keep = tmp_path / "sb.failed-logs"
    keep.mkdir()
    (keep / "thesis.tex").write_text("years of work\n")
    said = _failed_start(state, "log\n")
    assert len(said) == 1
    assert said[0].startswith(f"logs of the failed start not copied to {keep}: ")
    assert "no .hw-sandbox-failed-logs marker" in said[0]
    assert os.listdir(keep) == ["thesis.tex"]
    keep.rename(tmp_path / "elsewhere")
    keep.symlink_to(tmp_path / "elsewhere")  # a link to it: never followed
    said = _failed_start(state, "log\n")
    assert said[0].startswith(f"logs of the failed start not copied to {keep}: ")
    assert os.listdir(tmp_path / "elsewhere") == ["thesis.tex"]
    assert keep.is_symlink()
