"""The ``kind`` runtime: one kind node per profile node replica, fake hardware inside each.

Steps of ``up``, each named in errors:

1. ``preflight``: Docker answers, kind is on PATH, the node image is here (or pullable),
   no kind cluster of that name exists.
2. ``config``: the kind config from ``kind-config/`` (``kindconfig.py``), with what this
   Docker host needs (cgroup v1, a missing CAP_SYS_RESOURCE) and what the node image is
   (the minimal shape of ``kindimage.py`` or a stock ``kindest/node``).
3. ``cluster``: ``kind create cluster`` on a Docker network of its own.
4. ``image``: the sandbox image (``agentimage.py``: our packages on Debian's Python 3.11
   and FUSE), ``kind load``-ed into the nodes; with a node image from ``kindimage.py``
   only the layers the node lacks are shipped.
5. ``agent``: a privileged DaemonSet per replica mounts the replica's FUSE tree at
   /var/lib/hw-sandbox/root in its node and creates the device nodes in the node's /dev.
   That directory is bind-mounted from ``<state>/nodes/<replica>`` with bidirectional
   propagation, so the tree and its control socket are reachable from the host, where
   ``sandbox fault`` talks to them.
6. ``plugins``: our reference device plugin DaemonSet, until every node advertises.

The node image is ``SANDBOX_KIND_IMAGE``, else the locally built
``hw-sandbox/kind-node`` image, else kind's own default (pulled by kind).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from sandbox.errors import ControlError, RuntimeBackendError, SandboxError
from sandbox.manifests import find_plugin
from sandbox.profile import spec
from sandbox.profile.spec import Cluster
from sandbox.runtimes import kindtopology, kubeletns
from sandbox.runtimes.base import (
    NodeStatus,
    Progress,
    ResourceStatus,
    SandboxStatus,
    add_devices,
    add_pod_resources,
    is_ready,
    read_record,
    remove_state_dir,
    write_record,
)
from sandbox.runtimes.imagefiles import cache_root
from sandbox.runtimes.kindapi import (
    AGENT_NAMESPACE,
    SPEC_FILE,
    EarlyLoad,
    agent_manifests,
    api_client,
    create,
    docker_client,
    fail_on_broken_pods,
    ours,
    run_cli,
    scale_coredns_to_zero,
)
from sandbox.runtimes.kindconfig import NODE_LABEL, HostFacts, kind_config_text
from sandbox.runtimes.kindimage import KIND_VERSION, NODE_IMAGE, SHAPE_LABEL
from sandbox.runtimes.steps import Step, run_steps, undo_steps

AGENT_TIMEOUT = 180.0
PLUGIN_TIMEOUT = 120.0
# <state>/nodes/<replica>/pod-resources: the node's /var/lib/kubelet/pod-resources
POD_RESOURCES = "pod-resources"


def network_name(name: str) -> str:
    """Each sandbox's kind nodes get a Docker network of their own, removed by ``down``."""
    return f"hwsb-{name}"


# --- what gets deployed -----------------------------------------------------------------------

def _no_kind() -> str:
    """Why kind cannot run for want of a binary, and the one thing to do about it."""
    built = cache_root() / "tools" / f"kind-{KIND_VERSION}" / "kind"
    if built.is_file():
        return f"no kind on PATH; the test tooling built one: export PATH={built.parent}:$PATH"
    return f"no kind on PATH; install it with `go install sigs.k8s.io/kind@{KIND_VERSION}`"


# --- host facts -------------------------------------------------------------------------------

def _localdocker_client() -> bool:
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    return host.startswith("unix://")


def _caps_missing() -> bool:
    """This machine's capability bounding set lacks one the kernel has (CI VMs)."""
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapBnd:"):
                want = (1 << (last + 1)) - 1
                return int(line.split()[1], 16) & want != want
    except (OSError, ValueError):
        pass
    return False


def host_facts(client: Any, image: str) -> HostFacts:
    info = client.info()
    labels: dict[str, str] = {}
    with contextlib.suppress(Exception):
        labels = client.images.get(image).labels or {}
    return HostFacts(cgroup_v1=str(info.get("CgroupVersion", "2")) == "1",
                     restrict_oom=_localdocker_client() and _caps_missing(),
                     minimal=labels.get(SHAPE_LABEL) == "minimal")


def _propagation(path: Path) -> str:
    out = subprocess.run(["findmnt", "-n", "-o", "PROPAGATION", "--target", str(path)],
                         capture_output=True, text=True, check=False).stdout.split()
    return out[0] if out else ""


def _findmnt(*args: str) -> list[list[str]]:
    out = subprocess.run(["findmnt", "-rn", *args], capture_output=True, text=True,
                         check=False).stdout.splitlines()
    return [[f.replace("\\x20", " ") for f in line.split(" ")] for line in out]


def _mounts_under(path: Path) -> list[str]:
    """Mounts at or below ``path``, and bind mounts of a directory below it made elsewhere
    (Docker's bidirectional binds can surface on the host at the node's volume path:
    same device, a filesystem root inside ``path``), deepest first."""
    prefix = str(path).rstrip("/") + "/"
    found = {t for t, *_ in _findmnt("-o", "TARGET") if t == str(path) or t.startswith(prefix)}
    holder = _findmnt("-o", "TARGET,FSROOT,MAJ:MIN", "--target", str(path))
    # (only when ``path`` lies inside its filesystem: were it a mount root itself, every
    # mount of that device would "lie below" it)
    if holder and len(holder[0]) == 3 and os.path.relpath(path, holder[0][0]) != ".":
        target, fsroot, dev = holder[0]
        inner = os.path.normpath(os.path.join(fsroot, os.path.relpath(path, target)))
        for t, root, d in (r for r in _findmnt("-o", "TARGET,FSROOT,MAJ:MIN") if len(r) == 3):
            if d == dev and (root == inner or root.startswith(inner.rstrip("/") + "/")):
                found.add(t)
    return sorted(found, key=len, reverse=True)


def _serves_agent_log(api: Any, target: str) -> bool:
    """Has the restarted kubelet of node ``target`` taken its pods back? Until it has
    synced them from the API server again, it answers their logs with 404 (seen:
    ``kubectl logs`` of the agent just after ``up``)."""
    try:
        pods = api.list_namespaced_pod(AGENT_NAMESPACE, field_selector=f"spec.nodeName={target}",
                                       label_selector="app.kubernetes.io/name=hw-sandbox-agent")
        for pod in pods.items:
            api.read_namespaced_pod_log(pod.metadata.name, AGENT_NAMESPACE, tail_lines=1)
    except Exception:  # noqa: BLE001 - any failure: not yet
        return False
    return True


def exec_in_node(target: str, argv: list[str], step: str) -> str:
    """``docker exec TARGET ARGV``: its output, or RuntimeBackendError naming ``step``."""
    try:
        result = docker_client().containers.get(target).exec_run(argv)
    except Exception as exc:  # noqa: BLE001 - docker raises many types
        raise RuntimeBackendError(step, f"docker exec {target}: {exc}") from exc
    output = str(result.output.decode(errors="replace")).strip()
    if result.exit_code != 0:
        raise RuntimeBackendError(step, f"docker exec {target} {argv[0]} exited "
                                  f"{result.exit_code}: {output[-400:]}")
    return output


# --- the runtime ------------------------------------------------------------------------------

class KindRuntime:
    name = "kind"
    # False (`sandbox up --no-device-plugin`): the agent serves the fake hardware, and no
    # DaemonSet of our device plugin is made: a third-party plugin deployed next is the
    # only one advertising it
    reference_plugin = True
    # more flags for the reference device plugin's DaemonSet (--pre-start-required)
    plugin_options: tuple[str, ...] = ()
    # False (`sandbox up --kubelet-topology host`): the kubelets keep the host's machine
    # and kind's own settings (no restart on the emulated one)
    emulate_topology = True

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
            return _no_kind()
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
        up = _KindUp(self, cluster, profile_path, state_dir, progress)
        run_steps(_steps(state_dir, progress, up), progress)

    def _wait_agents(self, api: Any, cluster: Cluster, state_dir: Path,
                     progress: Progress) -> None:
        from sandbox.fakehw.control import ControlClient

        pending = {n.name for n in cluster.nodes}
        deadline = time.monotonic() + AGENT_TIMEOUT
        while pending:
            for node in sorted(pending):
                sock = state_dir / "nodes" / node / "control.sock"
                if not sock.exists():
                    continue
                with contextlib.suppress(SandboxError, OSError):
                    with ControlClient(sock, timeout=2) as client:
                        client.devices()
                    pending.discard(node)
                    progress(f"{node}: fake hardware served")
            if not pending:
                return
            fail_on_broken_pods(api, AGENT_NAMESPACE, "app.kubernetes.io/name=hw-sandbox-agent",
                                 "agent")
            if time.monotonic() > deadline:
                raise RuntimeBackendError(
                    "agent", f"the agent did not serve {', '.join(sorted(pending))} within "
                    f"{AGENT_TIMEOUT:.0f}s; see `kubectl -n {AGENT_NAMESPACE} logs "
                    "-l app.kubernetes.io/name=hw-sandbox-agent` (KUBECONFIG in the state dir)")
            time.sleep(0.25)

    def _wait_plugins(self, api: Any, cluster: Cluster, progress: Progress) -> None:
        from sandbox.runtimes.local import _advertisable

        want = {n.name for n in cluster.nodes if _advertisable(n, len(n.devices))}
        deadline = time.monotonic() + PLUGIN_TIMEOUT
        while want:
            for item in api.list_node().items:
                replica = (item.metadata.labels or {}).get(NODE_LABEL)
                capacity = item.status.capacity or {}
                if replica in want and any(ours(r) and int(v) > 0 for r, v in capacity.items()):
                    want.discard(replica)
                    progress(f"{replica}: kubelet advertises "
                             + ", ".join(f"{r}={v}" for r, v in sorted(capacity.items())
                                         if ours(r)))
            if not want:
                return
            fail_on_broken_pods(api, "kube-system",
                                 "app.kubernetes.io/name=hw-sandbox-device-plugin", "plugins")
            if time.monotonic() > deadline:
                raise RuntimeBackendError(
                    "plugins", f"no extended resource on {', '.join(sorted(want))} within "
                    f"{PLUGIN_TIMEOUT:.0f}s; see `kubectl -n kube-system logs "
                    "-l app.kubernetes.io/name=hw-sandbox-device-plugin`")
            time.sleep(0.25)

    def down(self, state_dir: Path, progress: Progress) -> None:
        problems = undo_steps(_steps(state_dir, progress), progress)
        if problems:
            raise RuntimeBackendError("down", "; ".join(problems))
        try:
            remove_state_dir(state_dir)
        except SandboxError as exc:
            raise RuntimeBackendError("down", str(exc)) from exc

    def status(self, state_dir: Path) -> SandboxStatus:
        record = read_record(state_dir) or {}
        out = SandboxStatus(state_dir.name, self.name, record.get("profile", "?"))
        kubeconfig = record.get("kubeconfig")
        if not kubeconfig:
            return out
        try:
            items = api_client(Path(kubeconfig)).list_node().items
        except Exception as exc:  # noqa: BLE001 - the API server is gone or unreachable
            raise RuntimeBackendError("status", f"the cluster's API server does not answer "
                                      f"({type(exc).__name__}); is the kind cluster "
                                      "running? `docker ps`") from exc
        replicas = record.get("nodes", {})
        for item in sorted(items, key=lambda i: i.metadata.name):
            labels = item.metadata.labels or {}
            replica = labels.get(NODE_LABEL)
            node = NodeStatus(replica or item.metadata.name, ready=is_ready(item))
            cap, alloc = item.status.capacity or {}, item.status.allocatable or {}
            for res, value in sorted(cap.items()):
                if ours(res):
                    node.resources.append(ResourceStatus(res, int(value),
                                                         int(alloc.get(res, 0))))
            info = replicas.get(replica)
            if info is not None:
                add_devices(node, Path(info["socket"]))
                add_pod_resources(node, self.pod_resources_socket(state_dir, node.name))
            out.nodes.append(node)
        return out

    def restart_kubelet(self, state_dir: Path, node: str) -> None:
        target = self._kind_node_for(state_dir, node)
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
        target = self._kind_node_for(state_dir, node)
        script = ("cd /var/lib/kubelet && for f in device-plugins/* plugins_registry/*; do "
                  "[ -S \"$f\" ] && [ \"$f\" != device-plugins/kubelet.sock ] && echo \"$f\"; "
                  "done; true")
        try:
            result = docker_client().containers.get(target).exec_run(["sh", "-c", script])
        except Exception as exc:  # noqa: BLE001 - docker raises many types
            raise ControlError(f"{node}: cannot list the kubelet's plugin sockets: {exc}") from exc
        return frozenset(result.output.decode(errors="replace").split())

    def pod_resources_socket(self, state_dir: Path, node: str) -> Path | None:
        """The node's /var/lib/kubelet/pod-resources is bind-mounted from here
        (kind-config/node.yaml); a unix socket works across a bind mount."""
        return state_dir / "nodes" / node / POD_RESOURCES / "kubelet.sock"

    def _kind_node_for(self, state_dir: Path, node: str) -> str:
        record = read_record(state_dir) or {}
        kubeconfig = record.get("kubeconfig")
        if not kubeconfig:
            raise SandboxError(f"sandbox {state_dir.name!r} has no kubeconfig")
        items = api_client(Path(kubeconfig)).list_node(label_selector=f"{NODE_LABEL}={node}").items
        if not items:
            raise SandboxError(f"no kind node carries {NODE_LABEL}={node}")
        return str(items[0].metadata.name)




class _KindUp:
    """One ``up``: the steps' ``do``s, sharing what earlier steps found out."""

    def __init__(self, runtime: KindRuntime, cluster: Cluster, profile_path: str,
                 state_dir: Path, progress: Progress) -> None:
        self.runtime, self.cluster, self.profile_path = runtime, cluster, profile_path
        self.state_dir, self.progress = state_dir, progress
        self.name = state_dir.name
        self.nodes = state_dir / "nodes"
        self.kubeconfig = state_dir / "kubeconfig"
        self.client = docker_client()
        self.image = ""
        self.facts = HostFacts()
        self.record: dict[str, Any] = {}

    def preflight(self) -> None:
        """No kind cluster of that name, the node image at hand; the record, each
        replica's state dir (its node's /var/lib/hw-sandbox) and resolved spec."""
        clusters = run_cli(["kind", "get", "clusters"], "preflight").split()
        if self.name in clusters:
            raise RuntimeBackendError(
                "preflight", f"a kind cluster named {self.name!r} already exists (not this "
                f"sandbox's); delete it with `kind delete cluster --name {self.name}` or pick "
                "another --name")
        for node in self.cluster.nodes if self.runtime.emulate_topology else ():
            problem = kubeletns.policy_problem(node, node.cpu_manager_policy)
            if problem:
                raise RuntimeBackendError("preflight", problem)
        image, present = self.runtime.node_image()
        if not present and os.environ.get("SANDBOX_KIND_IMAGE"):
            raise RuntimeBackendError(
                "preflight", f"node image {image} is not present locally (docker pull it, or "
                "build one offline with scripts/build-kind-node-image)")
        self.image = image
        self.record = {"name": self.name, "runtime": "kind", "profile": self.profile_path,
                       "created": time.time(), "nodes": {}, "image": image}
        for node in self.cluster.nodes:
            self.record["nodes"][node.name] = {
                "root": str(self.nodes / node.name / "root"),
                "socket": str(self.nodes / node.name / "control.sock")}
        write_record(self.state_dir, self.record)
        for node in self.cluster.nodes:  # bind-mounted at STATE_IN_NODE in the node container
            (self.nodes / node.name).mkdir(parents=True, exist_ok=True)
            (self.nodes / node.name / SPEC_FILE).write_text(spec.dump(node))
            # the node's kubelet's pod-resources dir (its socket is root's alone)
            (self.nodes / node.name / POD_RESOURCES).mkdir(mode=0o700, exist_ok=True)

    def config(self) -> None:
        """The kind config for this Docker host and node image; a shared mount for the
        nodes' state dirs (Bidirectional extraMounts need one on the host side)."""
        if self.image:
            self.facts = host_facts(self.client, self.image)
        else:
            self.facts = HostFacts(
                cgroup_v1=str(self.client.info().get("CgroupVersion", "2")) == "1",
                restrict_oom=_localdocker_client() and _caps_missing())
        kindtopology.install_wrapper(self.state_dir)
        config = self.state_dir / "kind-config.yaml"
        config.write_text(kind_config_text(self.cluster, self.name, self.state_dir,
                                           self.image or None, self.facts))
        if _localdocker_client() and _propagation(self.nodes) not in ("shared", "shared,slave"):
            run_cli(["mount", "--bind", str(self.nodes), str(self.nodes)], "config")
            self.record["bind_mount"] = str(self.nodes)
            write_record(self.state_dir, self.record)
            run_cli(["mount", "--make-rshared", str(self.nodes)], "config")

    def cluster_and_image(self) -> None:
        """``kind create cluster`` on a network of its own; the sandbox image is built and
        loaded while kind creates the cluster (unpacking it in the nodes is the slow part);
        if that fails it is loaded again afterwards."""
        self.record.update(kind_cluster=self.name, kubeconfig=str(self.kubeconfig),
                           network=network_name(self.name))
        write_record(self.state_dir, self.record)
        shape = "minimal shape: static CNI, no CoreDNS" if self.facts.minimal else ""
        self.progress(f"creating kind cluster {self.name}: {len(self.cluster.nodes)} node(s), "
                      f"image {self.image or 'kind default'}{f' ({shape})' if shape else ''}")
        env = {**os.environ, "KIND_EXPERIMENTAL_DOCKER_NETWORK": network_name(self.name)}
        with tempfile.TemporaryDirectory(prefix="hwsb-image-") as work:
            early = EarlyLoad(self.name, self.client, self.image, Path(work), self.progress)
            early.start()
            try:
                run_cli(["kind", "create", "cluster", "--name", self.name, "--config",
                         str(self.state_dir / "kind-config.yaml"), "--kubeconfig",
                         str(self.kubeconfig), "--wait", "180s"], "cluster", env=env)
            except RuntimeBackendError as exc:
                early.cancel()
                if not self.image and "pull" in exc.message.lower():
                    raise RuntimeBackendError(
                        "cluster", "kind could not pull its default node image (no registry "
                        "here?): build one offline with scripts/build-kind-node-image or set "
                        f"SANDBOX_KIND_IMAGE to a local one; {exc.message}") from exc
                raise
            early.finish()  # errors here name the step "image"

    def agent_and_plugins(self) -> None:
        """The agent DaemonSets and our device plugin, created together (the plugin finds
        the tree once the agent has mounted it; its mount sees the tree appear); then
        until every node serves its tree and advertises."""
        api = api_client(self.kubeconfig)
        if self.facts.minimal:
            scale_coredns_to_zero(api)
        plugin = self.runtime.reference_plugin
        self.progress("deploying the fake-hardware agent " + (
            "and the reference device plugin" if plugin else
            "(no device plugin: --no-device-plugin)"))
        create(api, agent_manifests(self.cluster), "agent")
        if plugin:
            manifests = list(yaml.safe_load_all(find_plugin("hw-sandbox-device-plugin").text()))
            for doc in manifests:
                if doc and doc.get("kind") == "DaemonSet":
                    for container in doc["spec"]["template"]["spec"]["containers"]:
                        container["args"] = [*container.get("args", []),
                                             *self.runtime.plugin_options]
            create(api, manifests, "plugins")
        self.runtime._wait_agents(api, self.cluster, self.state_dir, self.progress)
        if plugin:
            self.runtime._wait_plugins(api, self.cluster, self.progress)

    def topology(self) -> None:
        """Each profile node's kubelet restarted on its emulated machine
        (``kindtopology``), then until each node is Ready with the emulated CPU count and,
        with our plugin, advertises again."""
        if not self.runtime.emulate_topology:
            return
        api = api_client(self.kubeconfig)
        self.progress("restarting the kubelets on the emulated CPUs, NUMA nodes and memory")
        targets = {node.name: self.runtime._kind_node_for(self.state_dir, node.name)
                   for node in self.cluster.nodes}
        for node in self.cluster.nodes:
            kindtopology.write_node_files(self.nodes / node.name, node)
            exec_in_node(targets[node.name], ["sh", "-c", kindtopology.RECONFIGURE],
                         "topology")
        want = {node.name: len(node.cpus) for node in self.cluster.nodes}
        deadline = time.monotonic() + PLUGIN_TIMEOUT
        while want:
            for item in api.list_node().items:
                replica = (item.metadata.labels or {}).get(NODE_LABEL)
                if replica not in want:
                    continue
                capacity = item.status.capacity or {}
                allocatable = item.status.allocatable or {}
                advertises = not self.runtime.reference_plugin or not any(
                    ours(r) for r in capacity) or any(
                    ours(r) and int(v) > 0 for r, v in allocatable.items())
                if (is_ready(item) and capacity.get("cpu") == str(want[replica]) and advertises
                        and _serves_agent_log(api, targets[replica])):
                    self.progress(f"{replica}: kubelet sees cpu={capacity.get('cpu')}, "
                                  f"memory={capacity.get('memory')}")
                    del want[replica]
            if not want:
                return
            if time.monotonic() > deadline:
                raise RuntimeBackendError(
                    "topology", f"{', '.join(sorted(want))}: the kubelet did not come back "
                    f"on the emulated machine within {PLUGIN_TIMEOUT:.0f}s; see `docker exec "
                    f"{targets[sorted(want)[0]]} journalctl -u kubelet`")
            time.sleep(0.25)


def _node_volumes(cluster: str) -> dict[str, Path]:
    """The Docker volumes of ``cluster``'s node containers: name -> host path."""
    containers = docker_client().containers.list(
        all=True, filters={"label": f"io.x-k8s.kind.cluster={cluster}"})
    return {m["Name"]: Path(m["Source"]) for c in containers for m in c.attrs.get("Mounts", [])
            if m.get("Type") == "volume" and m.get("Name") and m.get("Source")}


def _unmount(mounts: list[str]) -> None:
    """Lazily unmount each of ``mounts`` (deepest first); SandboxError naming any that
    stays mounted."""
    problems = []
    for mount in mounts:
        result = subprocess.run(["umount", "-l", mount], capture_output=True, text=True,
                                check=False)
        if result.returncode != 0 and os.path.ismount(mount):
            problems.append(f"cannot unmount {mount}: {result.stderr.strip()}")
    if problems:
        raise SandboxError("; ".join(problems))


def _steps(state_dir: Path, progress: Progress, up: _KindUp | None = None) -> list[Step]:
    """``up``'s steps (with their ``do``s when given a ``_KindUp``); ``down`` undoes the
    same list: deleting the cluster removes the agents and plugins with it."""

    def delete_cluster() -> None:
        record = read_record(state_dir) or {}
        if record.get("kind_cluster"):
            volumes = _node_volumes(record["kind_cluster"])
            progress(f"deleting kind cluster {record['kind_cluster']}")
            run_cli(["kind", "delete", "cluster", "--name", record["kind_cluster"]], "down")
            # What the nodes' kubelets mounted below their /var volume (pods' projected
            # service-account tmpfs) surfaced on the host through the nodes' shared
            # propagation and outlives the nodes; it kept Docker from removing the
            # volumes with them, so they go now.
            _unmount([m for v in volumes.values() for m in _mounts_under(v)])
            client = docker_client()
            for volume in volumes:
                with contextlib.suppress(Exception):  # removed with its container after all
                    client.volumes.get(volume).remove()
        if record.get("network"):
            with contextlib.suppress(Exception):
                docker_client().networks.get(record["network"]).remove()

    def unmount_all() -> None:
        # The nodes' FUSE mounts propagated here (their servers died with the nodes), and
        # the shared bind mount the config step made.
        _unmount(_mounts_under(state_dir))

    steps = [Step("preflight"), Step("config", undo=unmount_all),
             Step("cluster", undo=delete_cluster), Step("agent"), Step("topology")]
    if up is None:
        return steps
    dos = [up.preflight, up.config, up.cluster_and_image, up.agent_and_plugins, up.topology]
    return [replace(step, do=do) for step, do in zip(steps, dos, strict=True)]
