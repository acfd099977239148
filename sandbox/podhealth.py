"""Per-pod device health: what a 1.37 kubelet writes into each container's status.

The kubelet reports, for every device a container was given, whether it is still
healthy: ``status.containerStatuses[].allocatedResourcesStatus`` = ``[{name, resources:
[{resourceID, health, message?}]}]`` (health ``Healthy``, ``Unhealthy`` or ``Unknown``).
For a device plugin ``name`` is the extended resource (``nvidia.com/gpu``) and
``resourceID`` the plugin's device id (a GPU UUID, a PCI or VF address, ``nvidia3``,
``card1``, ``dfl-port.2``); for DRA ``name`` is ``claim:<claim>[/<request>]`` and
``resourceID`` the first CDI device id the driver returned
(``hwsandbox.dev/gpu=<uid>-gpu-0000-01-00-0-1g-10gb-0``) or ``<driver>/<pool>/<device>``,
with a ``message`` such as ``aer-fatal: ...``.

``read_pod_health(kubeconfig, node)`` lists every such entry of the pods bound to
``node`` (all nodes: None) as ``PodDeviceHealth``, each matched to the profile's device
id where it can be (``device_owners``, ``owner_of``): that is how a fault injected on
``gpu3`` is seen to reach the pod that holds it. ``read_sandbox_pod_health`` does so for
every node of a sandbox (``sandbox status``), ``PodHealthLookup`` for one pod at a time
(the ``pod_health`` of ``sandbox.fakehw.control.scenario.run_scenario``). They read the raw JSON:
the client's model may predate the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from sandbox.errors import SandboxError
from sandbox.kubeapi import ApiError, Kube
from sandbox.profile.spec import Cluster, DeviceSpec, NodeSpec
from sandbox.runtimes.kind.config import NODE_LABEL

HEALTH = ("Healthy", "Unhealthy", "Unknown")


@dataclass(frozen=True)
class PodDeviceHealth:
    """One device of one container, as the kubelet reports its health."""

    namespace: str
    pod: str
    node: str
    container: str
    resource: str  # nvidia.com/gpu, or claim:<claim>[/<request>] for DRA
    resource_id: str  # the plugin's device id, or the DRA driver's CDI id
    health: str  # Healthy | Unhealthy | Unknown
    message: str = ""
    device: str = ""  # the profile's device id; "" where it is not known

    @property
    def holder(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def device_names(d: DeviceSpec) -> set[str]:
    """Every id a device plugin may give this device or its parts: the profile's id, the
    GPU UUID, PCI addresses of its functions and VFs, DRM card, /dev/nvidiaN, FPGA ports."""
    names = {d.id, d.uuid, *(f.address for f in d.functions)}
    if d.gpu is not None:
        names.update(d.gpu.vf_addresses)
        if d.gpu.drm_index >= 0:
            names.add(f"card{d.gpu.drm_index}")
        if d.vendor == "nvidia":
            names.add(f"nvidia{d.gpu.minor}")
    if d.nic is not None:
        names.update(a for pf in d.nic.vf_addresses for a in pf)
    if d.fpga is not None and d.fpga.first_port >= 0:
        names.update(f"dfl-port.{d.fpga.first_port + k}" for k in range(d.fpga.ports))
    names.discard("")
    return names


def _label(address: str) -> str:
    """A PCI address as the DRA driver puts it in a device name (``hwplugins.dra.discovery``
    ``dns_label``): ``0000:3b:00.1`` -> ``0000-3b-00-1``."""
    return re.sub(r"[^a-z0-9-]+", "-", address.lower()).strip("-")


def dra_names(d: DeviceSpec) -> set[str]:
    """The names the sandbox's DRA driver gives this device and its parts: ``gpu-``,
    ``nic-`` or ``fpga-<BDF>`` of each function, ``vf-<BDF>`` of its VFs and
    ``fpga-port-<N>`` of its FPGA ports (a GPU partition, ``<gpu name>-<profile>-<k>``,
    is found through its GPU's name)."""
    prefix = {"gpu": "gpu", "nic": "nic", "fpga": "fpga"}.get(d.kind)
    names = {f"{prefix}-{_label(f.address)}" for f in d.functions} if prefix else set()
    vfs = list(d.gpu.vf_addresses) if d.gpu is not None else []
    if d.nic is not None:
        vfs += [a for pf in d.nic.vf_addresses for a in pf]
    names.update(f"vf-{_label(a)}" for a in vfs if a)
    if d.fpga is not None and d.fpga.first_port >= 0:
        names.update(f"fpga-port-{d.fpga.first_port + k}" for k in range(d.fpga.ports))
    return names


def device_owners(spec: NodeSpec | None) -> dict[str, str]:
    """Every id a device plugin may use for a device or its parts -> the profile's id."""
    if spec is None:
        return {}
    return {name: d.id for d in spec.devices for name in device_names(d)}


def dra_owners(spec: NodeSpec | None) -> dict[str, str]:
    """Every DRA device name of the node's devices -> the profile's id."""
    if spec is None:
        return {}
    return {name: d.id for d in spec.devices for name in dra_names(d)}


def owner_of(resource_id: str, owners: Mapping[str, str], dra: Mapping[str, str]) -> str:
    """The profile's device id behind a kubelet's resource id ("" when none): an exact
    device-plugin id, else a DRA id (CDI ``vendor/class=<uid>-<name>[-<share>]`` or
    ``driver/pool/<name>``) naming one of the device's DRA names as a whole ``-``
    separated part; the longest name wins, so a partition maps to its GPU."""
    if resource_id in owners:
        return owners[resource_id]
    best, found = 0, ""
    for name, dev in dra.items():
        if len(name) > best and re.search(rf"(?:^|[-/=]){re.escape(name)}(?:$|-)",
                                          resource_id):
            best, found = len(name), dev
    return found


def _entries(pod: Mapping[str, Any]) -> Iterable[tuple[str, str, str, str, str]]:
    """(container, resource, resource id, health, message) of every reported device."""
    status = pod.get("status") or {}
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in status.get(key) or []:
            for alloc in cs.get("allocatedResourcesStatus") or []:
                for r in alloc.get("resources") or []:
                    yield (str(cs.get("name", "")), str(alloc.get("name", "")),
                           str(r.get("resourceID", "")), str(r.get("health", "Unknown")),
                           str(r.get("message") or ""))


def pod_health(pods: Iterable[Mapping[str, Any]], spec: NodeSpec | None = None,
               node: str | None = None) -> list[PodDeviceHealth]:
    """Every device health entry of ``pods`` (Pod objects as JSON), matched to the
    devices of ``spec`` (the profile's node, where it loads); ``node``: only pods bound
    to it. Sorted by pod, container, resource and id."""
    owners, dra = device_owners(spec), dra_owners(spec)
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        bound = str((pod.get("spec") or {}).get("nodeName") or "")
        if node is not None and bound != node:
            continue
        for container, resource, rid, health, message in _entries(pod):
            out.append(PodDeviceHealth(
                str(meta.get("namespace", "")), str(meta.get("name", "")), bound, container,
                resource, rid, health, message, owner_of(rid, owners, dra)))
    return sorted(out, key=lambda h: (h.namespace, h.pod, h.container, h.resource,
                                      h.resource_id))


@contextlib.contextmanager
def _core(kubeconfig: str, what: str) -> Iterator[Kube]:
    """A client of the cluster ``kubeconfig`` names; any failure inside becomes a
    one-line SandboxError ``cannot read <what>: ...``."""
    try:
        api = Kube.from_kubeconfig(kubeconfig)
    except Exception as exc:  # noqa: BLE001 - a bad or missing kubeconfig
        raise SandboxError(f"cannot read {what}: kubeconfig {kubeconfig}: "
                           f"{_first_line(exc)}") from exc
    try:
        yield api
    except SandboxError:
        raise
    except Exception as exc:  # noqa: BLE001 - ApiError, connection errors, bad JSON
        raise SandboxError(f"cannot read {what}: {_first_line(exc)}") from exc
    finally:
        api.close()


def read_pods(kubeconfig: str, node: str | None = None) -> list[dict[str, Any]]:
    """The Pod objects (raw JSON) bound to ``node`` (every pod: None); SandboxError with
    one line when the API server cannot be asked."""
    with _core(kubeconfig, "pods") as core:
        selector = f"spec.nodeName={node}" if node is not None else ""
        return core.items("/api/v1/pods", fieldSelector=selector or None)


def read_pod_health(kubeconfig: str, node: str | None = None,
                    spec: NodeSpec | None = None) -> list[PodDeviceHealth]:
    """The device health of every container of the pods bound to the Kubernetes node
    ``node`` (all: None), mapped onto the devices of ``spec`` (the profile's node)
    where given."""
    return pod_health(read_pods(kubeconfig, node), spec, node)


def _sandbox_names(core: Kube) -> dict[str, str]:
    """Kubernetes node name -> the sandbox's node name (kind labels its nodes
    ``hwsandbox.dev/node``; native names them as the sandbox does)."""
    nodes = core.items("/api/v1/nodes")
    out = {}
    for n in nodes:
        meta = n.get("metadata") or {}
        name = str(meta.get("name", ""))
        out[name] = str((meta.get("labels") or {}).get(NODE_LABEL) or name)
    return out


def read_sandbox_pod_health(kubeconfig: str, cluster: Cluster | None = None
                            ) -> dict[str, list[PodDeviceHealth]]:
    """Every pod's device health, by the sandbox's node name (``PodDeviceHealth.node`` is
    that name too), matched to the devices ``cluster`` (the profile) gives that node.
    Two API calls in all: the nodes and the pods."""
    with _core(kubeconfig, "pods") as core:
        names = _sandbox_names(core)
        pods = core.items("/api/v1/pods")
    out: dict[str, list[PodDeviceHealth]] = {}
    for pod in pods:
        bound = str((pod.get("spec") or {}).get("nodeName") or "")
        if not bound:
            continue
        node = names.get(bound, bound)
        spec = cluster.node(node) if cluster is not None else None
        out.setdefault(node, []).extend(
            dataclasses.replace(h, node=node) for h in pod_health([pod], spec))
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class PodHealthLookup:
    """``(namespace, pod, device, container) -> [(resource id, health)]`` of the entries
    of that pod's status that map onto the profile's ``device`` (or whose resource id is
    ``device`` itself), asked of the API server on each call: what a fault scenario's
    ``expect: {pod: ..., device: ..., health: ...}`` checks (``container``: only that
    container's entries). A pod that does not exist has none."""

    def __init__(self, kubeconfig: str, cluster: Cluster | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.cluster = cluster

    def entries(self, namespace: str, pod: str) -> list[PodDeviceHealth]:
        """Every device health entry of the pod (none: no such pod)."""
        with _core(self.kubeconfig, f"pod {namespace}/{pod}") as core:
            try:
                obj = core.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
            except ApiError as exc:
                if exc.status == 404:
                    return []
                raise
            bound = str((obj.get("spec") or {}).get("nodeName") or "")
            spec = None
            if self.cluster is not None and bound:
                spec = self.cluster.node(bound)
                if spec is None:  # kind: the Node's label names the sandbox's node
                    spec = self.cluster.node(_sandbox_names(core).get(bound, bound))
        return pod_health([obj], spec)

    def __call__(self, namespace: str, pod: str, device: str,
                 container: str | None = None) -> list[tuple[str, str]]:
        return [(h.resource_id, h.health) for h in self.entries(namespace, pod)
                if device in (h.device, h.resource_id)
                and container in (None, h.container)]
