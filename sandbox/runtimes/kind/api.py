"""What the kind runtime creates in, and reads from, a kind cluster (``sandbox.kubeapi``),
and the sandbox image's early load into the nodes (``EarlyLoad``).

``agent_manifests``: the agents' namespace and one privileged agent pod per node replica
(``sandbox mount`` of that replica at ``ROOT_IN_NODE``), which ``place_agents`` writes
into its node as a static pod. The rest are small API helpers for the runtime's steps.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from sandbox.commands import run
from sandbox.errors import CommandError, RuntimeBackendError, SandboxError
from sandbox.images import agent as agentimage
from sandbox.images.agent import IMAGE, PRELOADED_LABEL
from sandbox.kubeapi import Kube, name
from sandbox.profile.spec import Cluster
from sandbox.progress import Progress
from sandbox.runtimes.kind.config import NODE_LABEL

KIND_TIMEOUT = 900.0  # seconds: `kind create cluster`, `kind load` of a large image

AGENT_NAMESPACE = "hw-sandbox"
STATE_IN_NODE = "/var/lib/hw-sandbox"  # <state>/nodes/<replica> on the host
ROOT_IN_NODE = f"{STATE_IN_NODE}/root"
# the kubelet's pod-resources API, also mounted in the agent pod (the exec transport)
POD_RESOURCES_IN_NODE = "/var/lib/kubelet/pod-resources"
SPEC_FILE = "spec.json"  # the replica's resolved spec, written there by the host
# the agent pod, a static pod of the node's kubelet (kubeadm's staticPodPath)
STATIC_POD_IN_NODE = "/etc/kubernetes/manifests/hw-sandbox-agent.yaml"


def agent_namespace() -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": AGENT_NAMESPACE}}


def agent_pod(node: str) -> dict[str, Any]:
    """The agent of node replica ``node``: a static pod (``STATIC_POD_IN_NODE``), which
    the node's kubelet starts as soon as it starts, before it has joined the cluster; its
    mirror pod ``agent-<replica>-<kind node>`` shows it in the API. It serves the
    resolved spec the host wrote to its node's state dir (``SPEC_FILE``): every process of
    a sandbox works from the one spec the CLI resolved."""
    name = f"agent-{node}"
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": AGENT_NAMESPACE,
                     "labels": {"app": name, "app.kubernetes.io/part-of": "hw-sandbox",
                                "app.kubernetes.io/name": "hw-sandbox-agent"},
                     "annotations": {"kubectl.kubernetes.io/default-container": "agent"}},
        "spec": {
            # needs no pod network: works before (and without) any CNI
            "hostNetwork": True,
            # a static pod's priority is not resolved from its class by the kubelet
            # (kubeadm's control-plane pods carry both, too)
            "priorityClassName": "system-node-critical", "priority": 2000001000,
            "containers": [{
                "name": "agent", "image": IMAGE, "imagePullPolicy": "Never",
                "command": ["python3", "-m", "sandbox.agent", "--spec",
                            f"{STATE_IN_NODE}/{SPEC_FILE}", "--node", node,
                            ROOT_IN_NODE, "--state-dir", STATE_IN_NODE,
                            "--dev-dir", "/host-dev"],
                "env": [{"name": "HWSANDBOX_IN_NODE", "value": "1"}],
                "securityContext": {"privileged": True},
                "volumeMounts": [
                    {"name": "state", "mountPath": STATE_IN_NODE,
                     "mountPropagation": "Bidirectional"},
                    {"name": "dev", "mountPath": "/host-dev"},
                    # the kubelet's pod-resources API, for the exec transport
                    {"name": "pod-resources", "mountPath": POD_RESOURCES_IN_NODE},
                ],
            }, {
                # real links for the tree's netdevs in the node's network namespace
                # (hostNetwork: the node container's, never the host's), following its
                # faults (sandbox.fakehw.netlinks)
                "name": "netlinks", "image": IMAGE, "imagePullPolicy": "Never",
                "command": ["python3", "-m", "sandbox.fakehw.netlinks",
                            "--root", ROOT_IN_NODE,
                            "--control", f"{STATE_IN_NODE}/control.sock",
                            "--netns", "/proc/self/ns/net"],
                "securityContext": {"privileged": True},
                "volumeMounts": [
                    {"name": "state", "mountPath": STATE_IN_NODE,
                     "mountPropagation": "HostToContainer"},
                ],
            }],
            "volumes": [
                {"name": "state", "hostPath": {"path": STATE_IN_NODE,
                                               "type": "DirectoryOrCreate"}},
                {"name": "dev", "hostPath": {"path": "/dev"}},
                {"name": "pod-resources",
                 "hostPath": {"path": POD_RESOURCES_IN_NODE, "type": "DirectoryOrCreate"}},
            ],
        },
    }


def agent_manifests(cluster: Cluster) -> list[dict[str, Any]]:
    """The agent's namespace (created through the API) and one agent pod per node
    replica (written into its node as a static pod, ``place_agents``)."""
    return [agent_namespace(), *(agent_pod(node.name) for node in cluster.nodes)]


def place_agents(nodes: Sequence[Any], replicas: Sequence[str]) -> list[str]:
    """Write each replica's agent pod into its kind node's static pod directory; the kind
    node (of the cluster's node containers ``nodes``) of a replica is the one whose
    ``STATE_IN_NODE`` is bound from ``<state>/nodes/<replica>``. Returns the replicas
    placed. Written by a shell in the node (renamed into place: the kubelet skips dot
    files), not Docker's archive API, which mounts the node's volumes on the Docker host
    while it copies."""
    placed = []
    folder, file = STATIC_POD_IN_NODE.rsplit("/", 1)
    write = (f'umask 077 && printf "%s" "$HWSB_POD" > {folder}/.{file} && '
             f"mv {folder}/.{file} {folder}/{file}")
    for node in nodes:
        sources = [Path(m.get("Source") or "").name for m in node.attrs.get("Mounts") or []
                   if m.get("Destination") == STATE_IN_NODE]
        for replica in (s for s in sources if s in replicas):
            text = yaml.safe_dump(agent_pod(replica), sort_keys=False)
            result = node.exec_run(["sh", "-c", write], environment={"HWSB_POD": text})
            if result.exit_code != 0:
                raise SandboxError(f"writing the agent's static pod into {node.name}: "
                                   f"{result.output.decode(errors='replace').strip()}")
            placed.append(replica)
    return placed


def scale_coredns_to_zero(api: Any) -> None:
    """The minimal node image has no CoreDNS image: scale kubeadm's CoreDNS to zero rather
    than leave two pods in ImagePullBackOff (there is no cluster DNS either way)."""
    with contextlib.suppress(Exception):  # no such Deployment: nothing to do
        api.patch("/apis/apps/v1/namespaces/kube-system/deployments/coredns/scale",
                  {"spec": {"replicas": 0}})


def ours(resource: str) -> bool:
    """An extended resource (vendor-domain/name), not cpu, memory, pods or hugepages."""
    return "/" in resource and not resource.startswith(("hugepages-", "kubernetes.io/"))


def api_client(kubeconfig: Path) -> Kube:
    return Kube.from_kubeconfig(kubeconfig)


def kind_nodes(api: Kube, replicas: Sequence[str]) -> dict[str, str]:
    """Profile node replica -> its kind node (container) for each of ``replicas``, from
    one labelled node list; SandboxError naming a replica no node carries."""
    selector = f"{NODE_LABEL}={replicas[0]}" if len(replicas) == 1 else NODE_LABEL
    found = {item["metadata"]["labels"][NODE_LABEL]: name(item)
             for item in api.items("/api/v1/nodes", labelSelector=selector)}  # fmt: skip
    missing = [r for r in replicas if r not in found]
    if missing:
        raise SandboxError(f"no kind node carries {NODE_LABEL}={missing[0]}")
    return {r: found[r] for r in replicas}


def create(api: Kube, docs: list[dict[str, Any]], step: str) -> None:
    try:
        api.create([d for d in docs if d])
    except Exception as exc:  # noqa: BLE001 - ApiError, connection errors, ...
        raise RuntimeBackendError(step, f"creating the {step} objects failed: "
                                  f"{str(exc).strip().splitlines()[0]}") from exc


BROKEN = {"ErrImageNeverPull", "ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff",
           "CreateContainerConfigError", "CreateContainerError", "RunContainerError"}


def fail_on_broken_pods(api: Kube, namespace: str, selector: str, step: str) -> None:
    """Fail the step at once when one of its pods cannot start (no point waiting)."""
    for pod in api.items(f"/api/v1/namespaces/{namespace}/pods", labelSelector=selector):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting")
            if waiting is not None and waiting.get("reason") in BROKEN:
                reason = waiting["reason"]
                detail = str(waiting.get("message") or "").strip().splitlines()
                logs = ""
                if reason == "CrashLoopBackOff":
                    with contextlib.suppress(Exception):
                        text = api.log(namespace, name(pod), container=cs.get("name"),
                                       tailLines=3, previous=True)
                        logs = " | ".join(text.strip().splitlines())
                node = (pod.get("spec") or {}).get("nodeName")
                raise RuntimeBackendError(
                    step, f"pod {namespace}/{name(pod)} on {node}: "
                    f"{reason}{': ' + detail[0] if detail else ''}"
                    f"{' (last log: ' + logs + ')' if logs else ''}")


# a container in one of these states is being made: its pod has not settled
STARTING = {"ContainerCreating", "PodInitializing"}


def starting_pods(api: Kube, node: str) -> list[str]:
    """The pods on kind node ``node`` whose containers are still being made (no status
    yet, or waiting in ``STARTING``; not those backing off or being deleted). Restarting
    the kubelet between a container's create and its start costs the next kubelet ~3 s
    per such container as it starts (cAdvisor retries a cgroup that has no task yet; 13 s
    seen) and the container is made again: on a freshly joined node, kube-proxy's and the
    DaemonSets' pods are starting when its agent (a static pod) serves the tree."""
    starting = []
    for pod in api.items("/api/v1/pods", fieldSelector=f"spec.nodeName={node}"):
        status = pod.get("status") or {}
        if pod["metadata"].get("deletionTimestamp") or status.get("phase") in ("Succeeded",
                                                                                "Failed"):
            continue
        states = {cs.get("name"): cs.get("state") or {}
                  for cs in status.get("containerStatuses") or []}
        for container in pod["spec"]["containers"]:
            state = states.get(container["name"]) or {}
            if not state or (state.get("waiting") or {}).get("reason") in STARTING:
                starting.append(name(pod))
                break
    return starting


def install_nvml(state_dir: Path) -> list[Path]:
    """Our libnvidia-ml.so.1 (built here) where NVIDIA's pods mount it from: each node's
    /var/lib/hw-sandbox/nvml, which is ``<state>/nodes/<replica>/nvml`` on this host (the
    kind config's extraMount), with our nvidia-smi beside it; and a driver root of ours
    at each node's /var/lib/hw-sandbox/driver. Returns the libraries written."""
    from sandbox.nvml import build, node_driver_root, smi

    if sys.platform != "linux":
        raise SandboxError("building our NVML for Linux nodes needs a Linux host with gcc")
    lib = build()
    placed = []
    for node_dir in sorted((state_dir / "nodes").iterdir()):
        if node_dir.is_dir() and not node_dir.is_symlink():
            (node_dir / "nvml").mkdir(exist_ok=True)
            shutil.copy2(smi(), node_dir / "nvml" / smi().name)
            shutil.copy2(lib, node_dir / "nvml" / lib.name)
            node_driver_root(node_dir / "driver")
            placed.append(node_dir / "nvml" / lib.name)
    return placed


def docker_client() -> Any:
    import docker

    return docker.from_env(timeout=30)


def admin_api(client: Any, cluster: str) -> Kube:
    """A client of ``cluster``'s API server before ``kind create`` has written the
    kubeconfig: the control plane's admin.conf, pointed where kind's kubeconfig will
    point (the API server port Docker publishes on the host)."""
    node = client.containers.get(f"{cluster}-control-plane")
    read = node.exec_run(["cat", "/etc/kubernetes/admin.conf"])
    if read.exit_code:
        raise SandboxError("no admin.conf yet")
    conf = yaml.safe_load(read.output)
    binding = node.attrs["NetworkSettings"]["Ports"]["6443/tcp"][0]
    conf["clusters"][0]["cluster"]["server"] = (f"https://{binding['HostIp'] or '127.0.0.1'}:"
                                                f"{binding['HostPort']}")
    return Kube.from_dict(conf)


class EarlyLoad(threading.Thread):
    """Build the sandbox image and ``kind load`` it as soon as the nodes can take it: once
    kubeadm init has begun on the control plane, kind has finished restarting every
    node's containerd (its config action runs first), and write the agents' static pods
    into their nodes (``agents``: the kubelets start them as soon as they start). Then,
    with ``deploy``, call it with an API client as soon as the API server answers (the
    agents' namespace and the plugin DaemonSet: its pods start as the workers join, while
    kind still waits). ``finish`` waits for the load (placing the agents after it if the
    early load failed or never started, and loading again the ordinary way), and
    stops waiting for the API server (``deploy`` records what it made; a failure of it is
    kept in ``deploy_error``). With ``skip_control_plane`` (the profile names no
    control-plane node: kind's own runs no pod of ours) the image goes to the workers only,
    sparing the control plane its unpack while kubeadm starts it there."""

    def __init__(self, cluster: str, client: Any, node_image: str, work: Path,
                 progress: Progress, deploy: Callable[[Any], None] | None = None,
                 local: bool = False, skip_control_plane: bool = False,
                 agents: Sequence[str] = ()) -> None:
        super().__init__(name="hwsb-early-load", daemon=True)
        self.cluster, self.client, self.node_image = cluster, client, node_image
        self.work, self.progress, self.deploy = work, progress, deploy
        self.local = local  # the Docker daemon runs on this kernel (host transport)
        self.skip_control_plane = skip_control_plane
        self.agents = tuple(agents)  # the replicas whose agent pods to place once loaded
        self.cancelled = threading.Event()
        self.created = threading.Event()  # `kind create` is over: deploy no more
        self.agent: agentimage.AgentImage | None = None
        self.error: BaseException | None = None
        self.loaded = False
        self.deploy_error: SandboxError | None = None

    def cancel(self) -> None:
        self.cancelled.set()
        self.join(timeout=30)

    def _deploy_when_served(self) -> None:
        assert self.deploy is not None
        api = None
        while not (self.cancelled.is_set() or self.created.is_set()):
            try:
                api = api or admin_api(self.client, self.cluster)
                # the API answers, kubeadm's RBAC for admin.conf is there, and the
                # controller-manager runs (it made kube-system's default ServiceAccount)
                api.get("/api/v1/namespaces/kube-system/serviceaccounts/default")
            except Exception:  # noqa: BLE001 - not yet
                self.cancelled.wait(0.5)
                continue
            try:
                self.deploy(api)
            except SandboxError as exc:
                self.deploy_error = exc
            except Exception as exc:  # noqa: BLE001 - reported by the agent step
                self.deploy_error = RuntimeBackendError("agent", f"creating the agent: {exc}")
            return

    def _preloaded(self) -> frozenset[str]:
        if not self.node_image:
            return frozenset()
        try:
            labels = self.client.images.get(self.node_image).labels or {}
        except Exception:  # noqa: BLE001 - no labels: ship every layer
            return frozenset()
        return frozenset(filter(None, labels.get(PRELOADED_LABEL, "").split(",")))

    def _in_node(self, node: Any, path: str) -> bool:
        """Does ``path`` exist in kind node ``node``? Where the Docker daemon runs on this
        kernel, through /proc/PID/root of the node's init (once its /etc/hostname shows
        it is that node): a `docker exec` costs ~0.15 s of the two cores kubeadm is using.
        Elsewhere (a daemon in a VM) with `test -e` in the node."""
        pid = (node.attrs.get("State") or {}).get("Pid") or 0
        if self.local and pid:
            root = Path(f"/proc/{pid}/root")
            with contextlib.suppress(OSError):
                if (root / "etc/hostname").read_text().strip() == node.name:
                    return (root / path.lstrip("/")).exists()
        return bool(node.exec_run(["test", "-e", path]).exit_code == 0)

    def _nodes(self) -> list[Any]:
        """The cluster's node containers (running)."""
        nodes: list[Any] = self.client.containers.list(
            filters={"label": f"io.x-k8s.kind.cluster={self.cluster}"})
        return nodes

    def _nodes_take_images(self) -> bool:
        """kubeadm init has begun on the control plane (kind's config action, which may
        restart containerd, is over) and every node's containerd listens: systemd in a
        node may start containerd only after that, and an import then finds no socket."""
        nodes = self._nodes()
        control_plane = [n for n in nodes if n.name == f"{self.cluster}-control-plane"]
        return bool(control_plane) and self._in_node(
            control_plane[0], "/etc/kubernetes/manifests/kube-apiserver.yaml") and all(
            self._in_node(node, "/run/containerd/containerd.sock") for node in nodes)

    def _load(self) -> None:
        assert self.agent is not None
        if self.agent.archive is not None:
            argv = ["kind", "load", "image-archive", str(self.agent.archive)]
        else:
            argv = ["kind", "load", "docker-image", self.agent.ref]
        nodes = self._nodes()
        if self.skip_control_plane:
            workers = sorted(n.name for n in nodes
                             if n.labels.get("io.x-k8s.kind.role") != "control-plane")
            if workers:
                argv += ["--nodes", ",".join(workers)]
        try:
            run([*argv, "--name", self.cluster], timeout=KIND_TIMEOUT)
        except CommandError as exc:
            raise RuntimeBackendError("image", str(exc)) from exc
        # the image is in every node: their kubelets may start the agents now (with the
        # image missing they would back off for 10 s after ErrImageNeverPull)
        try:
            missing = set(self.agents) - set(place_agents(nodes, self.agents))
        except Exception as exc:  # noqa: BLE001 - docker raises many types
            raise RuntimeBackendError("agent", f"placing the agent pods: {exc}") from exc
        if missing:
            raise RuntimeBackendError("agent", "no kind node for "
                                      f"{', '.join(sorted(missing))} to run its agent")
        self.progress(f"the fake-hardware agent placed in {len(self.agents)} node(s) as a "
                      "static pod (their kubelets start it as they start)")

    def run(self) -> None:
        try:
            self.agent = agentimage.build(self.progress, self.work, self._preloaded())
            while not self.cancelled.is_set():
                with contextlib.suppress(Exception):
                    if self._nodes_take_images():
                        break
                self.cancelled.wait(0.2 if self.local else 0.5)
            else:
                return
            self.progress(f"loading {agentimage.IMAGE} into the node(s) while kubeadm runs "
                          f"({self.agent.shipped})")
            self._load()
            self.loaded = True
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self.error = exc
            return
        if self.deploy is not None:
            self._deploy_when_served()

    def finish(self) -> None:
        self.created.set()
        self.join()
        if self.loaded:
            return
        if self.agent is None and self.error is not None:
            raise self.error  # building the image failed: trying again cannot help
        if self.agent is None:
            self.agent = agentimage.build(self.progress, self.work, self._preloaded())
        if self.error is not None:
            self.progress(f"loading while kubeadm ran failed ({self.error}); again")
        self.progress(f"loading {agentimage.IMAGE} into the node(s) ({self.agent.shipped})")
        self._load()
