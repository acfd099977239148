"""profiles/workshop-mixed.yaml on kind: a control plane and three workers, each node
serving its own fake hardware; the control plane advertises none."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable

from tests.kind_e2e.conftest import KindSandbox

NAME = "hwsb-e2e-workshop"


def _memory_mib(name: str) -> int:
    """Memory the cluster's node containers use now (docker stats), in MiB."""
    out = subprocess.run(["docker", "stats", "--no-stream", "--format", "{{json .}}"],
                         capture_output=True, text=True, check=True).stdout
    total = 0.0
    for line in out.splitlines():
        row = json.loads(line)
        if row["Name"].startswith(name + "-"):
            used = row["MemUsage"].split("/")[0].strip()
            value, unit = float(used[:-3]), used[-3:]
            total += value * {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[unit]
    return int(total)


def _vf_resources(sb: KindSandbox) -> list[str]:
    """The net worker's extended resources with 4 devices: its X710's 2 ports x 2 VFs."""
    capacity = sb.nodes()["net-worker"]["status"]["capacity"]
    return [r for r, v in capacity.items()
            if "/" in r and not r.startswith(("hugepages-", "kubernetes.io/")) and int(v) == 4]


def test_each_worker_shows_its_own_hardware(sandbox_factory: Callable[..., KindSandbox]) -> None:
    sb = sandbox_factory("workshop-mixed.yaml", NAME)
    print(f"sandbox up (kind, workshop-mixed, 4 nodes): {sb.up_seconds:.1f}s, "
          f"node containers use {_memory_mib(NAME)} MiB")
    nodes = sb.nodes()
    assert set(nodes) == {"control-plane", "gpu-worker-0", "gpu-worker-1", "net-worker"}
    for node in nodes.values():
        assert any(c["type"] == "Ready" and c["status"] == "True"
                   for c in node["status"]["conditions"]), node["metadata"]["name"]
    # 4 L40S + 1 T4 per GPU worker; the T4 starts unhealthy (aer-fatal)
    for worker in ("gpu-worker-0", "gpu-worker-1"):
        sb.wait_resource(worker, "nvidia.com/gpu", (5, 4))
        assert nodes[worker]["metadata"]["labels"]["workshop/pool"] == "gpu"
    # the net worker: 2 ports x 2 VFs of an X710, nothing else
    sb.wait_for("net-worker advertises its VFs", lambda: bool(_vf_resources(sb)))
    (vfs,) = _vf_resources(sb)
    assert "nvidia.com/gpu" not in sb.nodes()["net-worker"]["status"]["capacity"]
    ours = [r for r in sb.nodes()["control-plane"]["status"]["capacity"]
            if "/" in r and not r.startswith(("hugepages-", "kubernetes.io/"))]
    assert ours == []
    # every replica has its own identity: the GPU UUIDs differ between the two workers
    status = json.loads(sb.sandbox("status", "--name", NAME, "-o", "json").stdout)
    by_node = {n["name"]: n for n in status["nodes"]}
    assert by_node["control-plane"]["devices"] == []
    assert len(by_node["gpu-worker-0"]["devices"]) == 5
    uuids = [
        {p.read_text() for p in (sb.state_dir / "nodes" / w / "root" / "proc" / "driver" /
                                 "nvidia" / "gpus").glob("*/information")}
        for w in ("gpu-worker-0", "gpu-worker-1")
    ]
    assert uuids[0]
    assert uuids[0].isdisjoint(uuids[1])
    # set-vfs reaches the net worker's kubelet: one port's VFs 2 -> 1, and back
    listed = json.loads(sb.sandbox("fault", "--name", NAME, "list", "net-worker", "-o",
                                   "json").stdout)["net-worker"]
    (nic,) = [dev for dev, info in listed.items() if info["kind"] == "nic"]
    sb.sandbox("fault", "--name", NAME, "set-vfs", "net-worker", nic, "1", "--port", "0")
    sb.wait_resource("net-worker", vfs, (3, 3), timeout=30)
    sb.sandbox("fault", "--name", NAME, "set-vfs", "net-worker", nic, "2", "--port", "0")
    sb.wait_resource("net-worker", vfs, (4, 4), timeout=30)
    # a fault on one worker reaches only that worker's kubelet
    sb.sandbox("fault", "--name", NAME, "unplug", "gpu-worker-1", "gpu0")
    sb.wait_resource("gpu-worker-1", "nvidia.com/gpu", (4, 3))
    assert sb.resource("gpu-worker-0", "nvidia.com/gpu") == (5, 4)
