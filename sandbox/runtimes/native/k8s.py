"""What the native runtime asks the API server (``sandbox.kubeapi``) and the kubelet."""

from __future__ import annotations

import socket

from sandbox.kubeapi import ApiError, Kube, is_ready
from sandbox.runtimes.base import NodeStatus, ResourceStatus
from sandbox.runtimes.native.common import DEVICE_PLUGINS_DIR, ORDER, Layout, running


def kubelet_running() -> bool:
    """Is a kubelet of some native sandbox already using the kubelet root?"""
    sock = DEVICE_PLUGINS_DIR / "kubelet.sock"
    if not sock.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(sock))
        except OSError:
            return False
    return True


def _client(layout: Layout) -> Kube:
    return Kube.from_kubeconfig(layout.kubeconfig)


def node_ready(layout: Layout, name: str) -> bool:
    with _client(layout) as api:
        try:
            node = api.get(f"/api/v1/nodes/{name}")
        except ApiError:
            return False
    return is_ready(node)


def default_service_account(layout: Layout) -> bool:
    """Does namespace default have its service account yet? The controller-manager makes
    it a few seconds after it starts; until then the API server refuses every pod there
    ("serviceaccount \"default\" not found")."""
    with _client(layout) as api:
        try:
            api.get("/api/v1/namespaces/default/serviceaccounts/default")
        except ApiError:
            return False
    return True


def node_status(layout: Layout, name: str) -> NodeStatus:
    from urllib3.exceptions import HTTPError  # e.g. NewConnectionError: no API server answers

    status = NodeStatus(name=name, ready=False)
    for proc in ORDER:
        if running(layout, proc) is None:
            status.down.append(proc)
            status.notes.append(f"{proc} is not running (log {layout.logs / (proc + '.log')})")
    if (layout.run / "dra-driver.pid").exists() and running(layout, "dra-driver") is None:
        status.down.append("dra-driver")
        status.notes.append(f"the DRA driver is not running (log {layout.logs / 'dra-driver.log'})")
    try:
        with _client(layout) as api:
            node = api.get(f"/api/v1/nodes/{name}")
    except (ApiError, HTTPError, OSError) as exc:
        status.notes.append(f"cannot read node {name}: {exc}")
        return status
    status.ready = is_ready(node)
    capacity = node["status"].get("capacity") or {}
    allocatable = node["status"].get("allocatable") or {}
    for resource in sorted(capacity):
        if "/" not in resource or resource.startswith("kubernetes.io/"):
            continue  # cpu, memory, hugepages-*: not extended resources
        status.resources.append(ResourceStatus(
            resource=resource,
            capacity=int(capacity[resource]),
            allocatable=int(allocatable.get(resource, "0")),
        ))
    return status
