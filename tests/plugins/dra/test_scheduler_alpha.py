"""The alpha DRA features of v1.37 with the REAL kube-scheduler: one control plane with
DRADeviceCompatibilityGroups and DRAOptionalNodeOperations on every component (the
last test restarts the scheduler without them: version skew). See test_scheduler.py for
the setup (``tests/plugins/dra/cluster.py``).

- ``dra-worker`` (tests/data/dra-nic-gpu.yaml): one A100 whose driver runs with
  ``--compatibility-groups``; its partitions come in three modes on the GPU's one counter
  set: ``mig`` (group mig), ``vgpu`` (group vgpu) and ``shared`` (no groups, from the
  driver config's ``compatibilityGroups: {shared: []}``); and a 10G NIC.
- ``net-worker`` (profiles/sriov-rdma.yaml): its SR-IOV VFs published for the control
  plane only (``--skip-node-operations vf``: slices with ``skipNodeOperations: ["*"]``);
  the Node starts WITHOUT ``status.declaredFeatures: [DRAOptionalNodeOperations]`` (what
  a kubelet with the gate off reports) and gets it later.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.plugins.dra.cluster import NS, REPO, Cluster, Node, attr, cel, example_devices
from tests.plugins.dra.cluster import cluster as start
from tests.plugins.dra.cluster import name as _name
from tests.plugins.dra.controlplane import apply_file

pytestmark = [pytest.mark.root, pytest.mark.network]

GATES = {"DRADeviceCompatibilityGroups": True, "DRAOptionalNodeOperations": True}
GPU = "gpu-0000-02-00-0"
OPTIONAL = "DRAOptionalNodeOperations"
EXAMPLE = "examples/dra/compatibility-groups.yaml"


def _three_modes(config: dict[str, Any]) -> None:
    parts = config["models"]["10de:20b2"]["partitions"]
    parts["modes"] = ["mig", "vgpu", "shared"]
    parts["compatibilityGroups"] = {"shared": []}


NODES = {
    "dra-worker": Node("tests/data/dra-nic-gpu.yaml", ["--compatibility-groups"],
                       edit_config=_three_modes),
    "net-worker": Node("profiles/sriov-rdma.yaml", ["--skip-node-operations", "vf"]),
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with start(NODES, GATES) as c:
        yield c


def _part(mode: str, profile: str = "1g.10gb") -> dict[str, Any]:
    return {"deviceClassName": "gpu-partition.hwsandbox.dev",
            "selectors": cel(f'{attr("parent")} == "{GPU}"', f'{attr("mode")} == "{mode}"',
                             f'{attr("profile")} == "{profile}"')}  # fmt: skip


def _requests(*modes: str) -> list[dict[str, Any]]:
    return [{"name": f"{m}{i}", "exactly": _part(m)} for i, m in enumerate(modes)]


def _unschedulable(cluster: Cluster, pod: str, *claims: str) -> None:
    message = cluster.unschedulable(pod)
    assert "cannot allocate all claims" in message, message
    assert not any(cluster.allocation(c) for c in claims)


def test_the_groups_reach_the_scheduler(cluster: Cluster) -> None:
    groups = {d["name"]: c.get("compatibilityGroups")
              for s in cluster.slices("dra-worker") for d in s["spec"].get("devices", [])
              for c in d.get("consumesCounters", [])}  # fmt: skip
    assert groups[f"{GPU}-1g-10gb-mig-0"] == ["mig"]
    assert groups[f"{GPU}-1g-10gb-vgpu-0"] == ["vgpu"]
    assert groups[f"{GPU}-1g-10gb-shared-0"] is None
    assert groups[GPU] is None  # the whole GPU: no groups, and it takes all counters


def test_modes_never_mix_within_one_claim(cluster: Cluster) -> None:
    claim, pod = _name("mix"), _name("mix")  # 2 of 8 memory slices: the counters fit
    devices = example_devices(EXAMPLE, "mig-and-vgpu")
    cluster.claim(claim, requests=devices["requests"], constraints=devices["constraints"])
    cluster.pod(pod, "dra-worker", claim=claim)
    _unschedulable(cluster, pod, claim)
    cluster.delete(pod, claim)


def test_modes_never_mix_across_claims_in_one_cycle(cluster: Cluster) -> None:
    """One pod, two claims: the scheduler allocates both in one scheduling cycle."""
    mig, vgpu, pod = _name("mig"), _name("vgpu"), _name("two")
    cluster.claim(mig, requests=_requests("mig"))
    cluster.claim(vgpu, requests=_requests("vgpu"))
    cluster.pod(pod, "dra-worker", claims=[mig, vgpu])
    _unschedulable(cluster, pod, mig, vgpu)
    cluster.delete(pod, mig, vgpu)


def test_one_group_is_co_allocated_and_holds_the_gpu(cluster: Cluster) -> None:
    """Two MIG partitions in one claim, and a third in another pod's claim, share the GPU;
    a vGPU partition waits until the last MIG partition is gone, then gets the GPU."""
    first, second, vgpu = _name("mig"), _name("mig"), _name("vgpu")
    devices = example_devices(EXAMPLE, "two-migs")
    cluster.claim(first, requests=devices["requests"], constraints=devices["constraints"])
    cluster.pod(first, "dra-worker", claim=first)
    devices = {r["device"] for r in cluster.allocated(first)}
    assert len(devices) == 2
    assert all(d.startswith(f"{GPU}-1g-10gb-mig-") for d in devices), devices
    cluster.claim(second, requests=_requests("mig"))
    cluster.pod(second, "dra-worker", claim=second)
    assert cluster.allocated(second)[0]["device"].startswith(f"{GPU}-1g-10gb-mig-")
    cluster.claim(vgpu, requests=_requests("vgpu"))
    cluster.pod(vgpu, "dra-worker", claim=vgpu)
    _unschedulable(cluster, vgpu, vgpu)
    cluster.delete(first, first)
    late = _name("vgpu")  # tried afresh: one MIG partition is still on the GPU
    cluster.claim(late, requests=_requests("vgpu"))
    cluster.pod(late, "dra-worker", claim=late)
    _unschedulable(cluster, late, late, vgpu)
    cluster.delete(second, second)  # no MIG partition left: both vGPU pods get one
    for claim in (vgpu, late):
        assert cluster.allocated(claim)[0]["device"].startswith(f"{GPU}-1g-10gb-vgpu-")
        cluster.delete(claim, claim)


def test_devices_without_groups_pair_only_with_each_other(cluster: Cluster) -> None:
    """The API's rule for no groups: co-allocated with siblings that have none (two
    ``shared`` partitions), never with a device that has groups (``shared`` + ``mig``)."""
    plain, mixed = _name("plain"), _name("mixed")
    cluster.claim(plain, requests=_requests("shared", "shared"))
    cluster.pod(plain, "dra-worker", claim=plain)
    assert all(r["device"].startswith(f"{GPU}-1g-10gb-shared-")
               for r in cluster.allocated(plain))  # fmt: skip
    cluster.delete(plain, plain)
    cluster.claim(mixed, requests=_requests("shared", "mig"))
    cluster.pod(mixed, "dra-worker", claim=mixed)
    _unschedulable(cluster, mixed, mixed)
    cluster.delete(mixed, mixed)


def test_control_plane_only_devices_need_the_node_feature(cluster: Cluster) -> None:
    """examples/dra/optional-node-operations.yaml as a workshop applies it: no node
    declares DRAOptionalNodeOperations (a kubelet with the gate off), so the pod is not
    scheduled; once net-worker declares it, the claim gets a VF and the allocation result
    carries ``skipNodeOperations: ["*"]`` (the kubelet will skip NodePrepareResources)."""
    slices = cluster.slices("net-worker")
    skipping = [s for s in slices if s["spec"].get("skipNodeOperations") == ["*"]]
    assert {d["name"][:3] for s in skipping for d in s["spec"]["devices"]} == {"vf-"}
    example = REPO / "examples/dra/optional-node-operations.yaml"
    apply_file(cluster.api, example)
    _unschedulable(cluster, "control-plane-vf", "control-plane-vf")
    cluster.core.patch_node_status("net-worker", {"status": {"declaredFeatures": [OPTIONAL]}})
    # The pending pod is not retried on that Node change (not within 60 s here: no
    # queueing hint covers it, only the scheduler's periodic flush): apply its Pod again.
    cluster.core.delete_namespaced_pod("control-plane-vf", NS, grace_period_seconds=0)
    cluster.wait("old pod gone", lambda: not any(
        p.metadata.name == "control-plane-vf"
        for p in cluster.core.list_namespaced_pod(NS).items))  # fmt: skip
    [pod_doc] = [d for d in yaml.safe_load_all(example.read_text()) if d["kind"] == "Pod"]
    cluster.core.create_namespaced_pod(NS, pod_doc)
    [result] = cluster.allocated("control-plane-vf")
    assert result["device"].startswith("vf-"), result
    assert result["skipNodeOperations"] == ["*"]
    pod = cluster.wait("pod bound", lambda: cluster.core.read_namespaced_pod(
        "control-plane-vf", NS).spec.node_name)  # fmt: skip
    assert pod == "net-worker"


def test_a_scheduler_without_the_gates_skips_the_pool(cluster: Cluster) -> None:
    """Version skew: the apiserver keeps the alpha fields, the scheduler (restarted
    without the gates) cannot honour compatibility groups, so it ignores the slice that
    uses them, which leaves dra-worker's pool incomplete: not even its NIC is allocated
    any more. A control-plane-only VF is handed out as an ordinary device (no
    ``skipNodeOperations`` in the result). Runs last (it restarts the scheduler)."""
    nic = {"deviceClassName": "nic.hwsandbox.dev"}
    before, after = _name("nic"), _name("nic")
    cluster.claim(before, nic)
    cluster.pod(before, "dra-worker", claim=before)
    assert cluster.allocated(before)[0]["device"] == "nic-0000-01-00-0"
    cluster.cp.start_scheduler({})
    cluster.claim(after, nic)
    cluster.pod(after, "dra-worker", claim=after)
    _unschedulable(cluster, after, after)
    assert cluster.allocation(before)  # what was allocated stays allocated
    vf = _name("vf")
    cluster.claim(vf, {"deviceClassName": "vf-control-plane.hwsandbox.dev"})
    cluster.pod(vf, "net-worker", claim=vf)
    [result] = cluster.allocated(vf)  # an ordinary device to this scheduler: the kubelet
    assert result["device"].startswith("vf-")  # WILL call NodePrepareResources (our
    assert "skipNodeOperations" not in result  # driver still prepares a VF then)
