"""The end-to-end tests' view of a native cluster (tests/e2e/conftest.py brings it up):
``NativeCluster`` and what a test asks of it (pods, their devices and health, DRA slices and
claims, logs), and the ``Footprint`` a ``down`` must leave empty. Imported as ``cluster``
(pytest puts tests/e2e on sys.path, as it does for ``conftest``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sandbox.profile.spec import NodeSpec
from sandbox.runtimes.native import (
    BUSYBOX_REF,
    Layout,
    NativeRuntime,
    bin_dir,
    kubelet_root,
    mounts_below,
    shim_pids,
)
from sandbox.runtimes.native import ctr as native_ctr
from sandbox.runtimes.native.cleanup import CREATED_MARKER, left_in
from sandbox.runtimes.native.hostpaths import host_links
from sandbox.supervisor import Proc
from sandbox.supervisor import start_time as proc_start_time

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "profiles" / "8gpu-2numa.yaml"
INTEL_PROFILE = REPO / "profiles" / "intel-flex-sriov.yaml"
MIG_PROFILE = REPO / "profiles" / "mig-partitions.yaml"
MIG_SINGLE_PROFILE = REPO / "profiles" / "mig-single.yaml"
# alpha in 1.37 (off by default): the partitions cluster turns it on in every component
MIG_FEATURE_GATES = {"DRADeviceCompatibilityGroups": True}
SRIOV_PROFILE = REPO / "profiles" / "sriov-rdma.yaml"
DPDK_PROFILE = REPO / "profiles" / "sriov-dpdk.yaml"
OPTIONAL_FEATURE_GATES = {"DRAOptionalNodeOperations": True}  # alpha in 1.37
if str(REPO) not in sys.path:  # tests.support (plugin builds) when run as `pytest tests/e2e`
    sys.path.append(str(REPO))

from tests.support import steps  # noqa: E402


@dataclass
class NativeCluster:
    runtime: NativeRuntime
    profile: Path
    state_dir: Path
    node: NodeSpec
    kubeconfig: Path
    core: Any  # kubernetes.client.CoreV1Api
    up_seconds: float
    up_returned: float = 0.0  # time.time() when `up` returned

    @property
    def layout(self) -> Layout:
        return Layout(self.state_dir)

    def ctr(self, *args: str) -> str:
        """``ctr`` against this cluster's containerd, namespace k8s.io (the CRI's)."""
        proc = subprocess.run(
            [*native_ctr(self.layout), *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, f"ctr {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def sandbox_cli(self, *args: str, timeout: float = 180) -> str:
        """``sandbox ARGS`` as a user runs it: it finds this cluster, the only one in its
        state root, through ``HWSANDBOX_STATE_DIR``."""
        env = dict(os.environ, HWSANDBOX_STATE_DIR=str(self.state_dir.parent))
        proc = subprocess.run(
            [sys.executable, "-m", "sandbox", *args],
            capture_output=True, text=True, timeout=timeout, check=False, env=env,
        )  # fmt: skip
        assert proc.returncode == 0, f"sandbox {' '.join(args)}: {proc.stdout}{proc.stderr}"
        return proc.stdout


@dataclass
class Footprint:
    """What a running native cluster has on the host, to check ``down`` removed it all."""

    processes: dict[int, str] = field(default_factory=dict)  # pid -> start time
    tasks: list[str] = field(default_factory=list)  # `ctr tasks ls` rows
    state_dir: Path = Path()
    made_kubelet_root: bool = False  # the kubelet root carries up's marker: down removes it

    def leftovers(self) -> list[str]:
        found = [f"process {pid} still runs" for pid, started in self.processes.items()
                 if proc_start_time(pid) == started]  # fmt: skip
        layout = Layout(self.state_dir)
        found += [f"mount {m}" for m in mounts_below(self.state_dir)]
        found += [f"mount {m}" for m in mounts_below(kubelet_root() / "pods")]
        found += [f"shim {pid}" for pid in shim_pids(layout.containerd_sock)]
        for path in (layout.containerd_sock, layout.dev, self.state_dir):
            if path.exists():
                found.append(f"{path} exists")
        found += [f"link {p} (plugins deploy)" for p in host_links(self.state_dir)]
        root = kubelet_root()
        if self.made_kubelet_root and root.exists():
            found.append(f"{root} exists (made by up): {left_in(root)}")
        return found


def footprint(cluster: NativeCluster) -> Footprint:
    layout = cluster.layout
    pids: list[int] = []
    for pid_file in layout.run.glob("*.pid"):
        proc = Proc.load(pid_file)
        if proc is not None:
            pids.append(proc.pid)
    pids += shim_pids(layout.containerd_sock)
    rows = cluster.ctr("tasks", "ls").splitlines()[1:]
    pids += [int(row.split()[1]) for row in rows]  # TASK PID STATUS
    processes = {pid: started for pid in pids if (started := proc_start_time(pid))}
    return Footprint(processes=processes, tasks=rows, state_dir=cluster.state_dir,
                     made_kubelet_root=(kubelet_root() / CREATED_MARKER).is_file())


def wait_until(
    what: str,
    check: Callable[[], bool],
    timeout: float = 120.0,
    describe: Callable[[], str] | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    with steps.timed(f"wait for {what}"):
        while not check():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}"
                            + (f": {describe()}" if describe else ""))
            time.sleep(0.5)


def kubectl(cluster: NativeCluster, *args: str, stdin: str | None = None) -> str:
    """The sandbox's built kubectl on its kubeconfig; its stdout (fails on an error)."""
    tool = bin_dir() / "kubectl"
    if not tool.is_file():
        pytest.fail(f"{tool} missing: run scripts/build-k8s", pytrace=False)
    with steps.timed(f"kubectl {' '.join(args)}"[:120]):
        result = subprocess.run([str(tool), "--kubeconfig", str(cluster.kubeconfig), *args],
                                input=stdin, capture_output=True, text=True, timeout=120,
                                check=False)
    assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result.stdout


def claim_pod_manifest(name: str, claim: str, command: str) -> dict[str, Any]:
    """``pod_manifest`` whose container uses the ResourceClaim ``claim`` (as "gpu")."""
    pod = pod_manifest(name, command, resources={"claims": [{"name": "gpu"}]})
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    return pod


def pod_manifest(name: str, command: str, **container: Any) -> dict[str, Any]:
    """A busybox pod (the image ``up`` imported; there is no registry) running ``command``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main",
                "image": BUSYBOX_REF,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", command],
                **container,
            }],
        },
    }


def phase(cluster: NativeCluster, name: str) -> str:
    return str(cluster.core.read_namespaced_pod(name, "default").status.phase)


def events(cluster: NativeCluster, pod: str) -> str:
    items = cluster.core.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={pod}").items
    return "; ".join(f"{e.reason}: {e.message}" for e in items)


def default_service_account(cluster: NativeCluster) -> bool:
    names = [sa.metadata.name for sa in
             cluster.core.list_namespaced_service_account("default").items]
    return "default" in names


def start_pod(cluster: NativeCluster, name: str, command: str, **container: Any) -> None:
    """Create the pod and wait until its container runs."""
    wait_until("the default service account", lambda: default_service_account(cluster))
    cluster.core.create_namespaced_pod("default", pod_manifest(name, command, **container))
    wait_until(f"pod {name} to run", lambda: phase(cluster, name) != "Pending",
               describe=lambda: events(cluster, name))
    assert phase(cluster, name) == "Running", events(cluster, name)


@contextlib.contextmanager
def running_pod(cluster: NativeCluster, name: str, command: str,
                **container: Any) -> Iterator[None]:
    """``start_pod``; delete the pod on exit."""
    try:
        start_pod(cluster, name, command, **container)
        yield
    finally:
        cluster.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def resource_counts(cluster: NativeCluster, resource: str) -> tuple[int, int]:
    """(capacity, allocatable) of an extended resource in the node's status."""
    status = cluster.core.read_node(cluster.node.name).status
    return (int((status.capacity or {}).get(resource, "0")),
            int((status.allocatable or {}).get(resource, "0")))


def wait_counts(cluster: NativeCluster, resource: str, want: tuple[int, int],
                timeout: float = 90) -> None:
    """Poll the node status (the kubelet posts it every 10 s) for capacity/allocatable."""
    wait_until(f"{resource} capacity/allocatable {want[0]}/{want[1]} on the node",
               lambda: resource_counts(cluster, resource) == want, timeout,
               describe=lambda: f"have {resource_counts(cluster, resource)}")


def pods_state(cluster: NativeCluster, namespace: str, label: str, tail: int = 40) -> str:
    """For a failure message: each pod of ``label`` in ``namespace`` with its phase,
    container states, events and the end of its log; "" when there is none."""
    out = []
    for p in cluster.core.list_namespaced_pod(namespace, label_selector=label).items:
        out.append(f"{p.metadata.name}: {p.status.phase} "
                   f"{[(c.name, c.state) for c in p.status.container_statuses or []]}")
        out += [f"  {e.reason}: {e.message}" for e in cluster.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={p.metadata.name}").items]
        try:
            out.append(str(cluster.core.read_namespaced_pod_log(
                p.metadata.name, namespace, tail_lines=tail)))
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            out.append(f"(no log: {exc})")
    return "\n".join(out)


def pod_log(cluster: NativeCluster, name: str) -> str:
    """default/``name``'s log once it runs, else ""."""
    if phase(cluster, name) != "Running":
        return ""
    return str(cluster.core.read_namespaced_pod_log(name, "default"))


def log_tail(log: Path) -> str:
    """The end of a plugin's log file, for a failure message."""
    return log.read_text(errors="replace")[-3000:]


@contextlib.contextmanager
def pod_resources() -> Iterator[Any]:
    """A ``PodResourcesLister`` stub (our own protos) on the kubelet's pod-resources socket.

    Open one per query: a restarted kubelet recreates the socket.
    """
    import grpc
    from hwplugins.api import podresources_v1_pb2_grpc

    sock = kubelet_root() / "pod-resources" / "kubelet.sock"
    with grpc.insecure_channel(f"unix://{sock}") as channel:
        yield podresources_v1_pb2_grpc.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]


def allocatable_devices(resource: str) -> dict[str, list[int]]:
    """GetAllocatableResources: device id -> NUMA node ids, for one resource."""
    from hwplugins.api import podresources_v1_pb2 as pr

    with pod_resources() as stub:
        reply = stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=10)
    return {dev_id: [n.ID for n in d.topology.nodes]
            for d in reply.devices if d.resource_name == resource for dev_id in d.device_ids}


def container_devices(pod: str, resource: str) -> dict[str, list[int]]:
    """List: device id -> NUMA node ids of ``resource`` given to default/``pod``'s container."""
    from hwplugins.api import podresources_v1_pb2 as pr

    with pod_resources() as stub:
        reply = stub.List(pr.ListPodResourcesRequest(), timeout=10)
    (found,) = [p for p in reply.pod_resources if (p.namespace, p.name) == ("default", pod)]
    (container,) = found.containers
    assert container.name == "main"
    return {dev_id: [n.ID for n in d.topology.nodes]
            for d in container.devices if d.resource_name == resource for dev_id in d.device_ids}


NVIDIA_GPU = "nvidia.com/gpu"


def nvidia_minors(cluster: NativeCluster) -> dict[str, int]:
    """GPU UUID -> device minor, from the node's /proc/driver/nvidia/gpus/*/information."""
    from tests.support.nvidia import tree_gpu_minors

    return tree_gpu_minors(cluster.state_dir / "node-root")


def check_two_gpu_pod(cluster: NativeCluster, pod: str) -> None:
    """A pod ``pod`` asking for 2 nvidia.com/gpu is given 2 of the node's GPUs
    (pod-resources), sees exactly their /dev/nvidiaN and has them in
    NVIDIA_VISIBLE_DEVICES."""
    minors = nvidia_minors(cluster)
    command = 'echo "visible=$NVIDIA_VISIBLE_DEVICES"; ls /dev; sleep 3600'
    with running_pod(cluster, pod, command, resources={"limits": {NVIDIA_GPU: "2"}}):
        given = container_devices(pod, NVIDIA_GPU)
        assert len(given) == 2, given
        assert set(given) <= set(minors), given
        wait_until("the pod's listing", lambda: "visible=" in pod_log(cluster, pod),
                   30, describe=lambda: f"events {events(cluster, pod)}")
        listing = pod_log(cluster, pod).split()
    (visible,) = [w for w in listing if w.startswith("visible=")]
    assert set(visible.removeprefix("visible=").split(",")) == set(given)
    assert sorted(n for n in listing if re.fullmatch(r"nvidia\d+", n)) == sorted(
        f"nvidia{minors[u]}" for u in given)


# -- the reference DRA driver's API objects (test_native_dra*.py) ---------------------------

DRIVER = "dra.hwsandbox.dev"
GROUP, VERSION, NS = "resource.k8s.io", "v1", "default"
DEVICE_CLASSES = REPO / "examples" / "dra" / "deviceclasses.yaml"


def ensure_device_classes(cluster: NativeCluster) -> None:
    """examples/dra/deviceclasses.yaml on the cluster; those an earlier test made are
    fine."""
    import yaml
    from kubernetes.client.exceptions import ApiException

    objects = custom_objects(cluster)
    for doc in yaml.safe_load_all(DEVICE_CLASSES.read_text()):
        try:
            objects.create_cluster_custom_object(GROUP, VERSION, "deviceclasses", doc)
        except ApiException as exc:
            if exc.status != 409:
                raise


def custom_objects(cluster: NativeCluster) -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(cluster.core.api_client)


def component_log(cluster: NativeCluster, name: str, tail: int = 40) -> str:
    """The last ``tail`` lines of a component's log (state_dir/logs/NAME.log), headed."""
    try:
        text = (cluster.layout.logs / f"{name}.log").read_text(errors="replace")
    except FileNotFoundError:
        return f"(no {name}.log)"
    return f"\n--- {name}.log (tail) ---\n" + "\n".join(text.splitlines()[-tail:])


def driver_slices(cluster: NativeCluster) -> list[dict[str, Any]]:
    """The DRA driver's ResourceSlices for the cluster's node."""
    items: list[dict[str, Any]] = custom_objects(cluster).list_cluster_custom_object(
        GROUP, VERSION, "resourceslices",
        field_selector=f"spec.nodeName={cluster.node.name},spec.driver={DRIVER}")["items"]
    return items


def slice_devices(cluster: NativeCluster) -> dict[str, dict[str, Any]]:
    """Device name -> device, over ``driver_slices``."""
    return {d["name"]: d for s in driver_slices(cluster) for d in s["spec"].get("devices", [])}


def read_claim(cluster: NativeCluster, name: str) -> dict[str, Any]:
    claim: dict[str, Any] = custom_objects(cluster).get_namespaced_custom_object(
        GROUP, VERSION, NS, "resourceclaims", name)
    return claim


def delete_object(cluster: NativeCluster, kind: str, name: str) -> None:
    """Delete default/``name``: a pod (``kind`` "pod") or a resource.k8s.io object of the
    plural ``kind``; one already gone is fine."""
    from kubernetes.client.exceptions import ApiException

    try:
        if kind == "pod":
            cluster.core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
        else:
            custom_objects(cluster).delete_namespaced_custom_object(GROUP, VERSION, NS, kind,
                                                                    name)
    except ApiException as exc:
        if exc.status != 404:
            raise


def gpu_minor(cluster: NativeCluster, pci: str) -> int:
    """The NVIDIA device minor of the GPU at ``pci``, from the node's driver information."""
    info = (cluster.state_dir / "node-root" / "proc" / "driver" / "nvidia" / "gpus" / pci
            / "information").read_text()
    match = re.search(r"^Device Minor:\s*(\d+)", info, re.M)
    assert match, info
    return int(match.group(1))


WITHIN = 5.0  # seconds: issue 29's bound from a fault to the pod's status


def resource_health(cluster: NativeCluster, pod: str) -> dict[str, dict[str, tuple[str, str]]]:
    """Resource name -> {resource id: (health, message)} of ``pod``'s first container, read
    raw (the official client may predate the fields)."""
    raw = json.loads(cluster.core.read_namespaced_pod(pod, NS, _preload_content=False).data)
    statuses = raw.get("status", {}).get("containerStatuses") or [{}]
    return {r["name"]: {h["resourceID"]: (h.get("health", ""), h.get("message", ""))
                        for h in r.get("resources") or []}
            for r in statuses[0].get("allocatedResourcesStatus") or []}


def wait_health(cluster: NativeCluster, pod: str, want: dict[str, str], resource: str,
                timeout: float = WITHIN, since: float | None = None) -> float:
    """Wait until each id in ``want`` has its health in ``pod``'s ``resource``, at most
    ``timeout`` seconds after ``since`` (a monotonic time, such as just before the fault
    command; default now); the seconds from ``since`` it took."""
    start = time.monotonic() if since is None else since
    timeout = max(0.0, timeout - (time.monotonic() - start))

    def now() -> dict[str, str]:
        return {i: h for i, (h, _m) in resource_health(cluster, pod).get(resource, {}).items()}

    wait_until(f"{pod}'s {resource} health {want}",
               lambda: all(now().get(i) == h for i, h in want.items()), timeout,
               describe=lambda: f"have {resource_health(cluster, pod)}")
    return time.monotonic() - start
