"""The ``kind`` runtime: one kind node per profile node replica, fake hardware inside each.

Steps of ``up``, each named in errors:

1. ``preflight``: Docker answers, kind is on PATH, the node image is here (or pullable),
   no kind cluster of that name exists.
2. ``config``: the kind config from ``kind-config/`` (``config.py``), with what this
   Docker host needs (cgroup v1, a missing CAP_SYS_RESOURCE) and what the node image is
   (the minimal shape of ``sandbox.images.node`` or a stock ``kindest/node``).
3. ``cluster``: ``kind create cluster`` on a Docker network of its own.
4. ``image``: the sandbox image (``sandbox.images.agent``: our packages on Debian's Python 3.11
   and FUSE), ``kind load``-ed into the nodes; with a node image from ``sandbox.images.node``
   only the layers the node lacks are shipped.
5. ``agent``: a privileged static pod per replica, written into its node once the image
   is there (the kubelet starts it as it starts, before the node joins), mounts the
   replica's FUSE tree at /var/lib/hw-sandbox/root in its node and creates the device
   nodes in the node's /dev.
   That directory is bind-mounted from ``<state>/nodes/<replica>`` with bidirectional
   propagation, so the tree and its control socket are reachable from the host, where
   ``sandbox fault`` talks to them.
6. ``plugins``: our reference device plugin DaemonSet, until every node advertises.
7. ``topology``: each profile node's kubelet restarted on its emulated CPUs, NUMA nodes
   and memory once its tree is served and its pods have started (``topology.py``), until
   it is Ready with the profile's CPU count and, with our plugin, advertises again.

The node image is ``SANDBOX_KIND_IMAGE``, else the locally built
``hw-sandbox/kind-node`` image, else kind's own default (pulled by kind).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from sandbox.commands import run
from sandbox.errors import ControlError, RuntimeBackendError, SandboxError
from sandbox.images.node import NODE_IMAGE
from sandbox.kubeapi import is_ready, labels, name
from sandbox.profile.spec import Cluster
from sandbox.progress import Progress
from sandbox.runtimes.base import (
    NodeStatus,
    ResourceStatus,
    SandboxStatus,
    add_devices,
    add_pod_resources,
    refuse_options,
)
from sandbox.runtimes.kind.api import (
    AGENT_NAMESPACE,
    KIND_TIMEOUT,
    api_client,
    docker_client,
    kind_nodes,
    ours,
)
from sandbox.runtimes.kind.config import NODE_LABEL
from sandbox.runtimes.kind.host import host_facts, no_kind
from sandbox.runtimes.kind.transport import in_agent, relayed, transport_for
from sandbox.runtimes.kind.up import POD_RESOURCES, KindUp, steps
from sandbox.runtimes.record import SandboxRecord, read_record
from sandbox.runtimes.steps import run_steps, take_down

__all__ = ["KindRuntime", "host_facts"]


class KindRuntime:
    name = "kind"

    def __init__(self, *, reference_plugin: bool = True, plugin_options: Sequence[str] = (),
                 emulate_topology: bool = True, feature_gates: Mapping[str, bool] | None = None,
                 dra_options: Sequence[str] = (), dra_driver: bool | None = None) -> None:
        # False (`sandbox up --no-device-plugin`): the agent serves the fake hardware, and
        # no DaemonSet of our device plugin is made: a third-party plugin deployed next is
        # the only one advertising it
        self.reference_plugin = reference_plugin
        # more flags for the reference device plugin's DaemonSet (--pre-start-required)
        self.plugin_options = tuple(plugin_options)
        # False (`sandbox up --kubelet-topology host`): the kubelets keep the host's
        # machine and kind's own settings (no restart on the emulated one)
        self.emulate_topology = emulate_topology
        # kind's own Kubernetes: no feature gates or DRA driver of ours (native has them)
        refuse_options(self.name, feature_gates=feature_gates, dra_options=dra_options,
                       dra_driver=dra_driver)

    def node_image(self) -> tuple[str, bool]:
        """(image, present locally): SANDBOX_KIND_IMAGE, else our built one if present,
        else ("", False): kind's default, pulled by kind."""
        explicit = os.environ.get("SANDBOX_KIND_IMAGE")
        candidate = explicit or NODE_IMAGE
        try:
            docker_client().images.get(candidate)
        except Exception:  # noqa: BLE001 - not present
            return (explicit, False) if explicit else ("", False)
        return candidate, True

    def unavailable_reason(self) -> str | None:
        if shutil.which("kind") is None:
            return no_kind()
        try:
            docker_client().ping()
        except Exception as exc:  # noqa: BLE001 - any failure means: no usable daemon
            return f"no Docker daemon reachable ({type(exc).__name__}; is dockerd running?)"
        image, present = self.node_image()
        if image and not present:
            return (f"SANDBOX_KIND_IMAGE={image} is not present locally "
                    "(docker pull it, or build one with scripts/build-kind-node-image)")
        return None

    def up(self, cluster: Cluster, profile_path: str, state_dir: Path,
           progress: Progress) -> None:
        up = KindUp(self, cluster, profile_path, state_dir, progress)
        run_steps(steps(state_dir, progress, up), progress)

    def down(self, state_dir: Path, progress: Progress) -> None:
        take_down(state_dir, steps(state_dir, progress), progress)

    def status(self, state_dir: Path) -> SandboxStatus:
        record = read_record(state_dir) or SandboxRecord()
        out = SandboxStatus(state_dir.name, self.name, record.profile or "?")
        kubeconfig = record.kubeconfig
        if not kubeconfig:
            return out
        try:
            with api_client(Path(kubeconfig)) as api:
                items = api.items("/api/v1/nodes")
        except Exception as exc:  # noqa: BLE001 - the API server is gone or unreachable
            raise RuntimeBackendError("status", f"the cluster's API server does not answer "
                                      f"({type(exc).__name__}); is the kind cluster "
                                      "running? `docker ps`") from exc
        replicas = record.nodes
        for item in sorted(items, key=name):
            replica = labels(item).get(NODE_LABEL)
            node = NodeStatus(replica or name(item), ready=is_ready(item))
            cap = item["status"].get("capacity") or {}
            alloc = item["status"].get("allocatable") or {}
            for res, value in sorted(cap.items()):
                if ours(res):
                    node.resources.append(ResourceStatus(res, int(value),
                                                         int(alloc.get(res, 0))))
            info = replicas.get(replica) if replica else None
            if info is not None:
                try:
                    with self.reach(state_dir, node.name, Path(info.socket)) as sock:
                        add_devices(node, sock)
                    pod_resources = self.pod_resources_socket(state_dir, node.name)
                    with self.reach(state_dir, node.name, pod_resources) as sock:
                        add_pod_resources(node, sock)
                except SandboxError as exc:  # the exec transport found no agent to ask
                    node.notes.append(str(exc))
            out.nodes.append(node)
        return out

    def restart_kubelet(self, state_dir: Path, node: str) -> None:
        target = self.kind_node_for(state_dir, node)
        try:
            result = docker_client().containers.get(target).exec_run(
                ["systemctl", "restart", "kubelet"])
        except Exception as exc:  # noqa: BLE001 - docker raises many types
            raise ControlError(f"restart-kubelet {node}: {exc}") from exc
        if result.exit_code != 0:
            raise ControlError(f"restart-kubelet {node}: systemctl exited {result.exit_code}: "
                               f"{result.output.decode(errors='replace').strip()}")

    def registered_plugins(self, state_dir: Path, node: str) -> frozenset[str]:
        """As the native runtime's: the plugin sockets in the node's kubelet root."""
        target = self.kind_node_for(state_dir, node)
        script = ("cd /var/lib/kubelet && for f in device-plugins/* plugins_registry/*; do "
                  "[ -S \"$f\" ] && [ \"$f\" != device-plugins/kubelet.sock ] && echo \"$f\"; "
                  "done; true")
        try:
            result = docker_client().containers.get(target).exec_run(["sh", "-c", script])
        except Exception as exc:  # noqa: BLE001 - docker raises many types
            raise ControlError(f"{node}: cannot list the kubelet's plugin sockets: {exc}") from exc
        return frozenset(result.output.decode(errors="replace").split())

    def pod_resources_socket(self, state_dir: Path, node: str) -> Path:
        """The node's /var/lib/kubelet/pod-resources is bind-mounted from here
        (kind-config/node.yaml); a unix socket works across a bind mount."""
        return state_dir / "nodes" / node / POD_RESOURCES / "kubelet.sock"

    def reach(self, state_dir: Path, node: str, socket: Path) -> AbstractContextManager[Path]:
        """``socket`` itself (the host transport), or a relay through the node's agent pod
        (the exec transport: Docker Desktop, a remote Docker host; ``transport``)."""
        record = read_record(state_dir) or SandboxRecord()
        if transport_for(record.transport) == "host" or not record.kubeconfig:
            return nullcontext(socket)
        return relayed(Path(record.kubeconfig), AGENT_NAMESPACE, f"app=agent-{node}",
                       in_agent(state_dir / "nodes" / node, socket), what=node)

    def load_images(self, state_dir: Path, images: Sequence[str], archives: Sequence[Path],
                    progress: Progress) -> None:
        """``kind load docker-image`` / ``image-archive`` into every node of the cluster."""
        record = read_record(state_dir) or SandboxRecord()
        cluster = record.kind_cluster
        if not cluster:
            raise SandboxError(f"sandbox {state_dir.name!r} has no kind cluster recorded")
        if shutil.which("kind") is None:
            raise SandboxError(no_kind())
        for what, sub in [*((i, "docker-image") for i in images),
                          *((str(a), "image-archive") for a in archives)]:
            progress(f"loading {what} into kind cluster {cluster}")
            run(["kind", "load", sub, what, "--name", cluster], timeout=KIND_TIMEOUT,
                step=f"load {what}")

    def kind_node_for(self, state_dir: Path, node: str) -> str:
        """The kind node (container) of profile node replica ``node``."""
        record = read_record(state_dir) or SandboxRecord()
        kubeconfig = record.kubeconfig
        if not kubeconfig:
            raise SandboxError(f"sandbox {state_dir.name!r} has no kubeconfig")
        with api_client(Path(kubeconfig)) as api:
            return kind_nodes(api, [node])[node]




