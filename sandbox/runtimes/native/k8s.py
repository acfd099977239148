"""What the native runtime asks the API server and the kubelet (the official client)."""

from __future__ import annotations

import socket
from typing import Any

from sandbox.runtimes.base import NodeStatus, ResourceStatus, is_ready
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


def _client(layout: Layout) -> Any:
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=str(layout.kubeconfig))
    return client.CoreV1Api(api_client)


def node_ready(layout: Layout, name: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    api = _client(layout)
    try:
        node = api.read_node(name)
    except ApiException:
        return False
    finally:
        api.api_client.close()
    return is_ready(node)


def default_service_account(layout: Layout) -> bool:
    """Does namespace default have its service account yet? The controller-manager makes
    it a few seconds after it starts; until then the API server refuses every pod there
    ("serviceaccount \"default\" not found")."""
    from kubernetes.client.exceptions import ApiException

    api = _client(layout)
    try:
        api.read_namespaced_service_account("default", "default")
    except ApiException:
        return False
    finally:
        api.api_client.close()
    return True


def node_status(layout: Layout, name: str) -> NodeStatus:
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError  # e.g. MaxRetryError: no API server answers

    status = NodeStatus(name=name, ready=False)
    for proc in ORDER:
        if running(layout, proc) is None:
            status.down.append(proc)
            status.notes.append(f"{proc} is not running (log {layout.logs / (proc + '.log')})")
    if (layout.run / "dra-driver.pid").exists() and running(layout, "dra-driver") is None:
        status.down.append("dra-driver")
        status.notes.append(f"the DRA driver is not running (log {layout.logs / 'dra-driver.log'})")
    api = _client(layout)
    try:
        node = api.read_node(name)
    except (ApiException, HTTPError, OSError) as exc:
        status.notes.append(f"cannot read node {name}: {exc}")
        return status
    finally:
        api.api_client.close()
    status.ready = is_ready(node)
    capacity = node.status.capacity or {}
    allocatable = node.status.allocatable or {}
    for resource in sorted(capacity):
        if "/" not in resource or resource.startswith("kubernetes.io/"):
            continue  # cpu, memory, hugepages-*: not extended resources
        status.resources.append(ResourceStatus(
            resource=resource,
            capacity=int(capacity[resource]),
            allocatable=int(allocatable.get(resource, "0")),
        ))
    return status
