"""The kubelet stand-in's status file (``kubelet serve --status-file``) is replaced whole
and never written through a link someone planted beside it (issue 21, output files)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sandbox.kubelet.resources import Snapshot
from sandbox.kubelet.status import read_status, write_status


def test_status_file_is_never_written_through_a_planted_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("keep\n")
    status = tmp_path / "run" / "status.json"
    status.parent.mkdir()
    # the temporary name the writer once used: pid-based, so guessable
    (status.parent / f".{status.name}.{os.getpid()}.tmp").symlink_to(outside)
    write_status(status, Snapshot({}))
    assert outside.read_text() == "keep\n"
    assert json.loads(status.read_text())["resources"] == {}
    assert read_status(status) == []
    assert status.stat().st_mode & 0o777 == 0o644
    left = sorted(p.name for p in status.parent.iterdir())
    assert left == [f".{status.name}.{os.getpid()}.tmp", "status.json"], left
