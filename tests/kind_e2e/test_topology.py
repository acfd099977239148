"""Issue 22 on kind with another topology policy: 8gpu-2numa under best-effort, where the
5-GPU pod that single-numa-node rejects (tests/kind_e2e/test_kind.py) runs with GPUs of
both NUMA nodes. The profile is the demo's with one kubelet setting changed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.kind_e2e.conftest import KindSandbox
from tests.kind_e2e.test_kind import GPU, _held, _numa_of_gpus, _phase, _pod

REPO = Path(__file__).resolve().parents[2]
NAME = "hwsb-e2e-topo"


def test_best_effort_admits_five_gpus_from_both_numa_nodes(
        sandbox_factory: Callable[..., KindSandbox],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    doc = yaml.safe_load((REPO / "profiles" / "8gpu-2numa.yaml").read_text())
    doc["nodes"][0]["kubelet"]["topologyManagerPolicy"] = "best-effort"
    profile = tmp_path_factory.mktemp("profiles") / "best-effort.yaml"
    profile.write_text(yaml.safe_dump(doc, sort_keys=False))
    sb = sandbox_factory(str(profile), NAME)
    sb.kubectl("apply", "-f", "-", input_text=json.dumps(
        _pod("five-gpus", "sleep 3600", {GPU: "5"})))
    sb.wait_for("five-gpus running", lambda: _phase(sb, "five-gpus").startswith("Running"))
    _, given = _held(sb, "five-gpus")
    assert len(given) == 5, given
    numa = _numa_of_gpus(sb)
    assert {numa[u] for u in given} == {0, 1}, given
