"""The driver's slices allocated by the REAL kube-scheduler (v1.37, default feature gates).

A real etcd, kube-apiserver, kube-scheduler and kube-controller-manager (resourceclaim
controller) run; Node objects stand in for kubelets (allocation needs none: the scheduler
writes ``status.allocation`` and binds the pod even if it never runs). The driver runs as
its own process per node against a rendered tree and publishes the node's pool
(``tests/plugins/dra/cluster.py``):

- ``mig-worker`` (profiles/mig-partitions.yaml): four partitionable A100 80GB;
- ``dra-worker`` (tests/data/dra-nic-gpu.yaml): a 10G NIC with consumable bandwidth and an
  A100 with two partition modes; its driver runs with ``--compatibility-groups``, which
  this apiserver (alpha gate off) silently drops (version skew; see
  test_scheduler_alpha.py for the gate on);
- ``net-worker`` (profiles/sriov-rdma.yaml): four multi-allocatable NICs on two NUMA nodes;
- ``fallback-worker`` (tests/data/dra-two-gpus.yaml): two partitionable A100.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.plugins.dra.cluster import DRIVER, NS, Cluster, Node, example_devices
from tests.plugins.dra.cluster import cluster as start
from tests.plugins.dra.cluster import name as _name

pytestmark = [pytest.mark.root, pytest.mark.network]

NODES = {
    "mig-worker": Node("profiles/mig-partitions.yaml"),
    "dra-worker": Node("tests/data/dra-nic-gpu.yaml", ["--compatibility-groups"]),
    "net-worker": Node("profiles/sriov-rdma.yaml"),
    "fallback-worker": Node("tests/data/dra-two-gpus.yaml"),
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with start(NODES, files=["examples/dra/deviceclasses.yaml",
                             "examples/dra/mig-partitions.yaml"]) as c:  # fmt: skip
        yield c


def _partition(gpu: str, profile: str) -> dict[str, Any]:
    expr = (f'device.attributes["{DRIVER}"].parent == "{gpu}" && '
            f'device.attributes["{DRIVER}"].profile == "{profile}"')  # fmt: skip
    return {"deviceClassName": "gpu-partition.hwsandbox.dev", "selectors": [{"cel": {
        "expression": expr}}]}  # fmt: skip


def _whole(gpu: str) -> dict[str, Any]:
    expr = f'device.attributes["resource.kubernetes.io"].pciBusID == "{_bdf(gpu)}"'
    return {"deviceClassName": "gpu.hwsandbox.dev", "selectors": [{"cel": {"expression": expr}}]}


def _bdf(gpu: str) -> str:
    d, b, s, f = gpu.removeprefix("gpu-").split("-")
    return f"{d}:{b}:{s}.{f}"


def test_partitions_that_fit_are_allocated_together(cluster: Cluster) -> None:
    gpu = "gpu-0000-01-00-0"
    names = [_name("fit") for _ in range(2)]
    for n in names:  # 2 x 3g.40gb = 8 memory slices, 6 compute slices: fits exactly
        cluster.claim(n, _partition(gpu, "3g.40gb"))
        cluster.pod(n, "mig-worker", claim=n)
    devices = [cluster.allocated(n)[0]["device"] for n in names]
    assert sorted(devices) == [f"{gpu}-3g-40gb-0", f"{gpu}-3g-40gb-1"]
    pods = [cluster.core.read_namespaced_pod(n, NS) for n in names]
    assert all(p.spec.node_name == "mig-worker" for p in pods)


def test_partitions_exceeding_the_counters_are_never_allocated_together(
    cluster: Cluster,
) -> None:
    gpu = "gpu-0000-02-00-0"
    first, second = _name("big"), _name("bigger")
    cluster.claim(first, _partition(gpu, "3g.40gb"))
    cluster.pod(first, "mig-worker", claim=first)
    assert cluster.allocated(first)[0]["device"].startswith(f"{gpu}-3g-40gb-")
    cluster.claim(second, _partition(gpu, "7g.80gb"))  # 4 + 8 memory slices > 8
    cluster.pod(second, "mig-worker", claim=second)
    message = cluster.unschedulable(second)
    assert "cannot allocate all claims" in message, message
    assert not (cluster.get_claim(second).get("status") or {}).get("allocation")
    cluster.delete(first, first)  # the counters come back: now the big one fits
    assert cluster.allocated(second)[0]["device"] == f"{gpu}-7g-80gb-0"


def test_a_whole_gpu_excludes_its_partitions(cluster: Cluster) -> None:
    gpu = "gpu-0000-81-00-0"
    whole, part = _name("whole"), _name("part")
    cluster.claim(whole, _whole(gpu))
    cluster.pod(whole, "mig-worker", claim=whole)
    assert cluster.allocated(whole)[0]["device"] == gpu
    cluster.claim(part, _partition(gpu, "1g.10gb"))
    cluster.pod(part, "mig-worker", claim=part)
    cluster.unschedulable(part)
    assert not (cluster.get_claim(part).get("status") or {}).get("allocation")


def test_example_template_gets_a_partition(cluster: Cluster) -> None:
    pod = _name("tmpl")
    cluster.pod(pod, "mig-worker", template="mig-1g-10gb")
    claim = cluster.wait("claim from the template", lambda: next(
        (s.resource_claim_name for s in (cluster.core.read_namespaced_pod(pod, NS).status
                                         .resource_claim_statuses or [])), None))  # fmt: skip
    result = cluster.allocated(claim)[0]
    assert result["driver"] == DRIVER
    assert result["pool"] == "mig-worker"
    assert "-1g-10gb-" in result["device"]


def test_nic_bandwidth_is_consumable_capacity(cluster: Cluster) -> None:
    nic = {"deviceClassName": "nic.hwsandbox.dev", "capacity": {"requests": {"bandwidth": "3G"}}}
    names = [_name("bw") for _ in range(4)]
    # One pod after another's allocation: created at once, the second of three 3G pods was
    # once refused ("cannot allocate all claims", 3G of 10G in use) while the first was
    # being bound, the third fitted 7 ms later, and nothing requeued the second before the
    # scheduler's 5-minute flush (3 of 4 two-worker runs, kube-scheduler v1.37.2): a race
    # in the scheduler, not in our slices, which did not change meanwhile.
    results = []
    for n in names[:3]:
        cluster.claim(n, nic)
        cluster.pod(n, "dra-worker", claim=n)
        results.append(cluster.allocated(n)[0])
    assert {r["device"] for r in results} == {"nic-0000-01-00-0"}
    assert all(r["consumedCapacity"] == {"bandwidth": "3G"} for r in results)
    assert len({r["shareID"] for r in results}) == 3  # one share per claim
    cluster.claim(names[3], nic)  # 4 x 3G > 10G
    cluster.pod(names[3], "dra-worker", claim=names[3])
    cluster.unschedulable(names[3])
    assert not (cluster.get_claim(names[3]).get("status") or {}).get("allocation")


def test_without_the_gate_groups_are_dropped_and_modes_mix(cluster: Cluster) -> None:
    """Version skew, the hazard compatibility groups exist for: a driver publishing two
    partition modes with groups (``--compatibility-groups``) to an apiserver without the
    alpha gate. The apiserver DROPS the field, so the scheduler sees partitions of both
    modes on one counter set with no groups, and co-allocates a MIG-like and a vGPU-like
    partition of one GPU - which no real GPU can do. Hence the flag is off by default."""
    gpu = "gpu-0000-02-00-0"
    devices = [d for s in cluster.slices("dra-worker") for d in s["spec"].get("devices", [])]
    assert {d["attributes"]["mode"]["string"] for d in devices if "mode" in d["attributes"]
            } == {"mig", "vgpu"}  # fmt: skip
    assert not any(c.get("compatibilityGroups") for d in devices
                   for c in d.get("consumesCounters", []))  # fmt: skip
    assert "dropped the fields of feature gate DRADeviceCompatibilityGroups" in (
        cluster.logs["dra-worker"].read_text())  # the driver says so
    claim, pod = _name("mixed"), _name("mixed")
    devices = example_devices("examples/dra/compatibility-groups.yaml", "mig-and-vgpu")
    cluster.claim(claim, requests=devices["requests"], constraints=devices["constraints"])
    cluster.pod(pod, "dra-worker", claim=claim)
    got = {r["request"]: r["device"] for r in cluster.allocated(claim)}
    assert got["mig"].startswith(f"{gpu}-1g-10gb-mig-"), got
    assert got["vgpu"].startswith(f"{gpu}-1g-10gb-vgpu-"), got
    cluster.delete(pod, claim)


def test_distinct_attribute_forces_distinct_nics(cluster: Cluster) -> None:
    """examples/dra/distinct-nics.yaml. Multi-allocatable NICs: without a constraint, two
    requests of one claim get two shares of one NIC; ``distinctAttribute`` on the PCI
    address forces two NICs, on the NUMA node one NIC per NUMA node (``count: 2``), and
    three on distinct NUMA nodes (there are two) never fit."""
    nic = {"deviceClassName": "nic.hwsandbox.dev", "capacity": {"requests": {"bandwidth": "10G"}}}
    same, pod = _name("same"), _name("same")
    cluster.claim(same, requests=[{"name": n, "exactly": nic} for n in ("eth0", "eth1")])
    cluster.pod(pod, "net-worker", claim=same)
    results = cluster.allocated(same)
    assert [r["device"] for r in results] == ["nic-0000-01-00-0"] * 2, results
    assert len({r["shareID"] for r in results}) == 2  # two shares of the one NIC

    example = "examples/dra/distinct-nics.yaml"
    claims = {_name("distinct"): example_devices(example, "two-nics"),
              _name("numa"): example_devices(example, "two-nics-two-numa")}  # fmt: skip
    for claim, devices in claims.items():
        cluster.claim(claim, requests=devices["requests"], constraints=devices["constraints"])
    cluster.pod(_name("distinct"), "net-worker", claims=list(claims))
    distinct, numa = (cluster.allocated(c) for c in claims)
    assert len({r["device"] for r in distinct}) == 2, distinct
    assert all(r["consumedCapacity"] == {"bandwidth": "10G"} for r in distinct)
    numa_of = {d["name"]: d["attributes"]["resource.kubernetes.io/numaNode"]["int"]
               for s in cluster.slices("net-worker") for d in s["spec"].get("devices", [])}
    assert sorted(numa_of[r["device"]] for r in numa) == [0, 1], numa

    three, pod = _name("three"), _name("three")
    cluster.claim(three, requests=[{"name": "nics", "exactly": {**nic, "count": 3}}],
                  constraints=[{"requests": ["nics"],
                                "distinctAttribute": "resource.kubernetes.io/numaNode"}])
    cluster.pod(pod, "net-worker", claim=three)
    message = cluster.unschedulable(pod)
    assert "cannot allocate all claims" in message, message
    assert not cluster.allocation(three)


def test_first_available_falls_back_to_a_partition(cluster: Cluster) -> None:
    """examples/dra/prioritized-alternatives.yaml on two A100s: a whole GPU first; with one
    GPU whole and the other partitioned, the partition; then nothing."""
    devices = example_devices("examples/dra/prioritized-alternatives.yaml", "gpu-or-partition")

    def claim_and_pod(prefix: str) -> tuple[str, str]:
        claim, pod = _name(prefix), _name(prefix)
        cluster.claim(claim, requests=devices["requests"])
        cluster.pod(pod, "fallback-worker", claim=claim)
        return claim, pod

    whole, _ = claim_and_pod("prefer")
    [got] = cluster.allocated(whole)
    assert got["request"] == "gpu/whole", got
    first_gpu = got["device"]
    other = ({"gpu-0000-01-00-0", "gpu-0000-02-00-0"} - {first_gpu}).pop()
    small = _name("small")  # one 1g.10gb partition: the other GPU is no longer whole
    cluster.claim(small, _partition(other, "1g.10gb"))
    cluster.pod(small, "fallback-worker", claim=small)
    cluster.allocated(small)
    fallback, _ = claim_and_pod("fallback")
    [got] = cluster.allocated(fallback)
    assert got["request"] == "gpu/partition", got
    assert got["device"].startswith(f"{other}-3g-40gb-"), got
    _, pod = claim_and_pod("none")  # 1g + 3g used: 3 of 8 memory slices left, 3g needs 4
    message = cluster.unschedulable(pod)
    assert "cannot allocate all claims" in message, message


def test_a_tainted_device_is_not_allocated(cluster: Cluster) -> None:
    """An AER fatal error in sysfs: the driver taints the GPU (NoExecute) at its next rescan
    and the scheduler no longer hands it out."""
    pci = cluster.roots["dra-worker"] / "sys/bus/pci/devices/0000:02:00.0"
    gpu = "gpu-0000-02-00-0"
    assert (pci / "class").read_text().startswith("0x03")
    (pci / "aer_dev_fatal").write_text("TOTAL_ERR_FATAL 1\n")

    def tainted() -> bool:
        return any(d["name"] == gpu and d.get("taints") for s in cluster.slices("dra-worker")
                   for d in s["spec"].get("devices", []))  # fmt: skip

    cluster.wait("the GPU tainted", tainted, timeout=10)
    name = _name("tainted")
    cluster.claim(name, _whole(gpu))
    cluster.pod(name, "dra-worker", claim=name)
    cluster.unschedulable(name)
    assert not (cluster.get_claim(name).get("status") or {}).get("allocation")
