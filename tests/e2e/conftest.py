"""End-to-end fixtures: a real single-node Kubernetes (the ``native`` runtime).

The native runtime owns ``/var/lib/kubelet``, so only one cluster runs at a time. The
session-scoped ``sandboxes`` keeps at most one up and switches profiles on demand:
``native_cluster`` is ``profiles/8gpu-2numa.yaml``, ``dra_cluster`` the same profile with
the reference DRA driver instead of the device plugin, ``mig_cluster``
``profiles/mig-partitions.yaml`` with the DRA driver and an alpha feature gate,
``intel_cluster`` is ``profiles/intel-flex-sriov.yaml``. Modules are collected in name
order (test_native.py, test_native_dra.py, ..., test_native_topology.py); the tests are
then grouped by the cluster fixture they use (``pytest_collection_modifyitems`` below):
every test of a cluster runs where that cluster's first test was, so each cluster comes up
once (13 ups instead of 20, ~15 s each). Tests sharing a cluster leave its hardware as
the profile says (their ``finally``s). A test marked ``takes_cluster_down`` runs last on
its cluster. Every ``down`` (a switch, the end of the session, or
test_down_leaves_nothing_behind) is checked: no process, mount, device node, containerd
socket or state dir of that cluster may remain.

Missing prerequisites FAIL the tests with the command that fixes them
(``scripts/build-k8s``, ``scripts/build-containerd``, ``scripts/build-plugins``); nothing is
skipped.

Run: ``sudo scripts/build-k8s && scripts/build-containerd && sudo tox -e e2e`` (or
``pytest tests/e2e`` as root).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import (
    DPDK_PROFILE,
    INTEL_PROFILE,
    MIG_FEATURE_GATES,
    MIG_PROFILE,
    MIG_SINGLE_PROFILE,
    OPTIONAL_FEATURE_GATES,
    PROFILE,
    SRIOV_PROFILE,
    NativeCluster,
    default_service_account,
    footprint,
)

from sandbox.profile.loader import load_profile
from sandbox.runtimes.native import (
    NativeRuntime,
)
from tests.support import steps

# the fixtures that bring up a cluster of their own configuration (see Sandboxes.get)
CLUSTER_FIXTURES = ("native_cluster", "dra_cluster", "mig_cluster", "optional_cluster",
                    "sriov_cluster", "dpdk_cluster", "nvidia_cluster", "mig_single_cluster",
                    "mig_nvidia_cluster", "intel_cluster")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "takes_cluster_down: runs after every other test of its cluster fixture")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group the tests by cluster fixture, at the place of each group's first test, in
    collection order otherwise; a test using none stays a group of its own."""
    groups: dict[object, list[pytest.Item]] = {}
    for item in items:
        names = getattr(item, "fixturenames", ())
        key = next((n for n in CLUSTER_FIXTURES if n in names), item)
        groups.setdefault(key, []).append(item)
    items[:] = [item for group in groups.values() for item in sorted(
        group, key=lambda i: i.get_closest_marker("takes_cluster_down") is not None)]


def _options(reference_plugin: bool, dra_driver: bool, feature_gates: dict[str, bool] | None,
             dra_options: tuple[str, ...], plugin_options: tuple[str, ...]) -> str:
    """A cluster's configuration as a step's name says it."""
    said = [] if reference_plugin else ["no plugin"]
    said += ["DRA driver"] if dra_driver else []
    said += [f"gates {','.join(feature_gates)}"] if feature_gates else []
    said += [" ".join(options) for options in (dra_options, plugin_options) if options]
    return f"({'; '.join(said)})" if said else ""


class Sandboxes:
    """At most one native cluster at a time (it owns /var/lib/kubelet)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.current: NativeCluster | None = None
        self._api_client: Any = None

    def get(self, profile: Path, reference_plugin: bool = True, dra_driver: bool = False,
            feature_gates: dict[str, bool] | None = None,
            dra_options: tuple[str, ...] = (),
            plugin_options: tuple[str, ...] = ()) -> NativeCluster:
        current = self.current
        gates = dict(feature_gates or {})
        if current is not None and (current.profile, current.runtime.reference_plugin,
                                    current.runtime.dra_driver, current.runtime.feature_gates,
                                    tuple(current.runtime.dra_options),
                                    current.runtime.plugin_options) == (
                profile, reference_plugin, dra_driver, gates, dra_options, plugin_options):
            return current
        self.release()
        return self._up(profile, reference_plugin, dra_driver, gates, dra_options,
                        plugin_options)

    def _up(self, profile: Path, reference_plugin: bool, dra_driver: bool = False,
            feature_gates: dict[str, bool] | None = None,
            dra_options: tuple[str, ...] = (),
            plugin_options: tuple[str, ...] = ()) -> NativeCluster:
        runtime = NativeRuntime(feature_gates=feature_gates, reference_plugin=reference_plugin,
                                dra_driver=dra_driver, dra_options=dra_options,
                                plugin_options=plugin_options)
        reason = runtime.unavailable_reason()
        if reason is not None:
            pytest.fail(f"native runtime unavailable: {reason}")
        try:
            from kubernetes import client, config
        except ImportError:
            pytest.fail("the kubernetes Python client is missing: pip install -e '.[test]'")
        loaded = load_profile(profile)
        state_dir = self.factory.mktemp("native") / "state"
        start = time.monotonic()
        try:
            said = _options(reference_plugin, dra_driver, feature_gates, dra_options,
                            plugin_options)
            with steps.timed(f"up {profile.name} {said}".rstrip()):
                runtime.up(loaded.cluster, str(profile), state_dir, lambda _m: None)
        except BaseException:
            runtime.down(state_dir, lambda _m: None)  # as `sandbox up` does on failure
            raise
        up_seconds = time.monotonic() - start
        up_returned = time.time()
        self._api_client = config.new_client_from_config(
            config_file=str(state_dir / "kubeconfig"))
        self.current = NativeCluster(
            runtime=runtime,
            profile=profile,
            state_dir=state_dir,
            node=loaded.cluster.nodes[0],
            kubeconfig=state_dir / "kubeconfig",
            core=client.CoreV1Api(self._api_client),
            up_seconds=up_seconds,
            up_returned=up_returned,
        )
        # a user's `kubectl apply` of a pod right after `up` must not be refused
        assert default_service_account(self.current), "up returned before the default SA"
        return self.current

    def release(self) -> None:
        """Take the current cluster (if any) down and check it left nothing behind."""
        if self.current is None:
            return
        before = footprint(self.current)
        self.down()
        assert before.leftovers() == [], f"down of {before.state_dir} left things behind"

    def down(self) -> None:
        cluster, self.current = self.current, None
        if cluster is None:
            return
        self._api_client.close()
        # down removes the state dir; keep the component logs for a failed run.
        keep = self.factory.mktemp(f"native-logs-{cluster.profile.stem}")
        shutil.copytree(cluster.layout.logs, keep, dirs_exist_ok=True)
        with steps.timed(f"down {cluster.profile.name}"):
            cluster.runtime.down(cluster.state_dir, lambda _m: None)
        assert not cluster.state_dir.exists(), f"down left {cluster.state_dir} behind"


@pytest.fixture(scope="session")
def sandboxes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandboxes]:
    boxes = Sandboxes(tmp_path_factory)
    try:
        yield boxes
    finally:
        boxes.release()


@pytest.fixture
def native_cluster(sandboxes: Sandboxes) -> NativeCluster:
    """``profiles/8gpu-2numa.yaml``: node gpu-worker, 8 H100 (0-3 on NUMA 0, 4-7 on 1)."""
    return sandboxes.get(PROFILE)


@pytest.fixture
def dra_cluster(sandboxes: Sandboxes) -> NativeCluster:
    """``profiles/8gpu-2numa.yaml`` with the reference DRA driver (``hwplugins.dra``) started
    by the runtime (``NativeRuntime(dra_driver=True)``) and no device plugin, so the GPUs
    reach pods only through DRA."""
    return sandboxes.get(PROFILE, reference_plugin=False, dra_driver=True)


@pytest.fixture
def mig_cluster(sandboxes: Sandboxes) -> NativeCluster:
    """``profiles/mig-partitions.yaml`` (node mig-worker, 4 partitionable A100 80GB) with the
    reference DRA driver and no device plugin, ``MIG_FEATURE_GATES`` on in every component
    (``NativeRuntime(feature_gates=...)``, what ``sandbox up --feature-gates`` sets)."""
    return sandboxes.get(MIG_PROFILE, reference_plugin=False, dra_driver=True,
                         feature_gates=MIG_FEATURE_GATES)


@pytest.fixture
def optional_cluster(sandboxes: Sandboxes) -> NativeCluster:
    """``profiles/sriov-rdma.yaml`` (node net-worker, SR-IOV NICs with VFs) with the reference
    DRA driver publishing its VFs for the control plane only (``--skip-node-operations vf``,
    what ``sandbox up --dra-skip-node-operations vf`` passes) and ``OPTIONAL_FEATURE_GATES``
    on in every component."""
    return sandboxes.get(SRIOV_PROFILE, reference_plugin=False, dra_driver=True,
                         feature_gates=OPTIONAL_FEATURE_GATES,
                         dra_options=("--skip-node-operations", "vf"))


@pytest.fixture
def sriov_cluster(sandboxes: Sandboxes) -> NativeCluster:
    """``profiles/sriov-rdma.yaml`` without our reference device plugin: the SR-IOV network
    device plugin (run by the test) is the only one advertising its VFs."""
    return sandboxes.get(SRIOV_PROFILE, reference_plugin=False)


@pytest.fixture
def dpdk_cluster(sandboxes: Sandboxes) -> NativeCluster:
    """``profiles/sriov-dpdk.yaml`` (node dpdk-worker: E810 VFs on vfio-pci, ConnectX-6 Dx VFs
    with netdevs) without our reference device plugin."""
    return sandboxes.get(DPDK_PROFILE, reference_plugin=False)


@pytest.fixture
def nvidia_cluster(sandboxes: Sandboxes) -> NativeCluster:
    """``profiles/8gpu-2numa.yaml`` without our reference device plugin: NVIDIA's (run by
    the test) is the only one."""
    return sandboxes.get(PROFILE, reference_plugin=False)


@pytest.fixture
def mig_single_cluster(sandboxes: Sandboxes) -> NativeCluster:
    """``profiles/mig-single.yaml`` (node mig-worker, 4 A100 80GB holding 2 x 3g.40gb each)
    without our reference device plugin: NVIDIA's (run by the test) is the only one."""
    return sandboxes.get(MIG_SINGLE_PROFILE, reference_plugin=False)


@pytest.fixture
def mig_nvidia_cluster(sandboxes: Sandboxes) -> NativeCluster:
    """``profiles/mig-partitions.yaml`` with neither our device plugin nor our DRA driver:
    NVIDIA's DRA driver (deployed by the test) is the only one publishing its GPUs."""
    return sandboxes.get(MIG_PROFILE, reference_plugin=False)


@pytest.fixture
def intel_cluster(sandboxes: Sandboxes) -> NativeCluster:
    """``profiles/intel-flex-sriov.yaml``: node flex-worker, two Flex 170 (one with 4 VFs).

    Without our reference device plugin, which would serve gpu.intel.com/i915 too: the
    third-party plugins under test are the only ones registered with the kubelet.
    """
    return sandboxes.get(INTEL_PROFILE, reference_plugin=False)


# -- device health in pod status (test_native_health.py, test_native_nvidia.py) -------------
