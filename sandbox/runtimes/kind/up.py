"""One ``sandbox up`` of the kind runtime as named steps (``steps``), each a method of
``KindUp`` sharing what earlier steps found out; ``down`` undoes the same list (see the
package docstring for what each step does)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from sandbox.commands import run
from sandbox.errors import CommandError, RuntimeBackendError, SandboxError
from sandbox.kubeapi import Kube, is_ready, labels, name
from sandbox.manifests import find_plugin
from sandbox.profile import spec
from sandbox.profile.spec import Cluster
from sandbox.progress import Progress
from sandbox.runtimes import kubeletns
from sandbox.runtimes.base import advertisable
from sandbox.runtimes.kind import topology as kindtopology
from sandbox.runtimes.kind.api import (
    AGENT_NAMESPACE,
    KIND_TIMEOUT,
    SPEC_FILE,
    EarlyLoad,
    agent_namespace,
    api_client,
    create,
    docker_client,
    fail_on_broken_pods,
    kind_nodes,
    ours,
    scale_coredns_to_zero,
    starting_pods,
)
from sandbox.runtimes.kind.config import NODE_LABEL, HostFacts, kind_config_text
from sandbox.runtimes.kind.host import (
    caps_missing,
    host_facts,
    localdocker_client,
    mounts_under,
    propagation,
    unmount,
)
from sandbox.runtimes.kind.host import delete_cluster as delete_kind_cluster
from sandbox.runtimes.kind.transport import choose as choose_transport
from sandbox.runtimes.record import NodeRecord, SandboxRecord, read_record, write_record
from sandbox.runtimes.steps import Step

if TYPE_CHECKING:
    from sandbox.runtimes.kind import KindRuntime

AGENT_TIMEOUT = 180.0
PLUGIN_TIMEOUT = 120.0
# at most this long for a node's pods to start before its kubelet is restarted anyway
SETTLE_TIMEOUT = 20.0
# <state>/nodes/<replica>/pod-resources: the node's /var/lib/kubelet/pod-resources
POD_RESOURCES = "pod-resources"


def network_name(name: str) -> str:
    """Each sandbox's kind nodes get a Docker network of their own, removed by ``down``."""
    return f"hwsb-{name}"


def _serves_agent_log(api: Kube, target: str) -> bool:
    """Has the restarted kubelet of node ``target`` taken its pods back? Until it has
    synced them from the API server again, it answers their logs with 404 (seen:
    ``kubectl logs`` of the agent just after ``up``)."""
    try:
        pods = api.items(f"/api/v1/namespaces/{AGENT_NAMESPACE}/pods",
                         fieldSelector=f"spec.nodeName={target}",
                         labelSelector="app.kubernetes.io/name=hw-sandbox-agent")
        if not pods:
            return False  # its mirror pod is not made yet
        for pod in pods:
            api.log(AGENT_NAMESPACE, name(pod), container="agent", tailLines=1)
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


class KindUp:
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
        self.record = SandboxRecord()
        self.deployed = False  # the agent (and plugin) objects exist in the cluster
        self.deploy_error: SandboxError | None = None
        self.docker_info: dict[str, Any] = {}  # `docker info`, asked once by preflight

    def preflight(self) -> None:
        """No kind cluster of that name, the node image at hand; the record, each
        replica's state dir (its node's /var/lib/hw-sandbox) and resolved spec."""
        clusters = run(["kind", "get", "clusters"], timeout=KIND_TIMEOUT).stdout.split()
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
        # `docker info` once: the daemon gathers it anew on each call (0.15-0.3 s here,
        # before `kind create` starts); the config step reads it too
        try:
            self.docker_info = dict(self.client.info())
        except Exception:  # noqa: BLE001 - docker raises many types; kind fails if so
            self.docker_info = {}
        transport, why = choose_transport(self.client, self.docker_info)
        if transport != "host":
            self.progress(f"node sockets through the Kubernetes API (exec transport): {why}")
        self.record = SandboxRecord(
            name=self.name, runtime="kind", profile=self.profile_path, created_at=time.time(),
            image=image, transport=transport, nodes={node.name: NodeRecord(
                root=str(self.nodes / node.name / "root"),
                socket=str(self.nodes / node.name / "control.sock"))
                for node in self.cluster.nodes})
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
            self.facts = host_facts(self.client, self.image, self.docker_info)
        else:
            self.facts = HostFacts(
                cgroup_v1=str(self.docker_info.get("CgroupVersion", "2")) == "1",
                restrict_oom=localdocker_client() and caps_missing())
        kindtopology.install_wrapper(self.state_dir)
        config = self.state_dir / "kind-config.yaml"
        config.write_text(kind_config_text(self.cluster, self.name, self.state_dir,
                                           self.image or None, self.facts))
        if localdocker_client() and propagation(self.nodes) not in ("shared", "shared,slave"):
            run(["mount", "--bind", str(self.nodes), str(self.nodes)], timeout=KIND_TIMEOUT)
            self.record = replace(self.record, bind_mount=str(self.nodes))
            write_record(self.state_dir, self.record)
            run(["mount", "--make-rshared", str(self.nodes)], timeout=KIND_TIMEOUT)

    def cluster_and_image(self) -> None:
        """``kind create cluster`` on a network of its own; the sandbox image is built and
        loaded while kind creates the cluster (unpacking it in the nodes is the slow part);
        if that fails it is loaded again afterwards. Once loaded, the agent and plugin
        objects are created as soon as the API server answers (``_deploy``), so that their
        pods start while kind joins the workers and waits for them."""
        self.record = replace(self.record, kind_cluster=self.name,
                              kubeconfig=str(self.kubeconfig), network=network_name(self.name))
        write_record(self.state_dir, self.record)
        shape = "minimal shape: static CNI, no CoreDNS" if self.facts.minimal else ""
        self.progress(f"creating kind cluster {self.name}: {len(self.cluster.nodes)} node(s), "
                      f"image {self.image or 'kind default'}{f' ({shape})' if shape else ''}")
        env = {**os.environ, "KIND_EXPERIMENTAL_DOCKER_NETWORK": network_name(self.name)}
        with tempfile.TemporaryDirectory(prefix="hwsb-image-") as work:
            early = EarlyLoad(self.name, self.client, self.image, Path(work), self.progress,
                              deploy=self._deploy, local=self.record.transport == "host",
                              skip_control_plane=not any(n.role == "control-plane"
                                                         for n in self.cluster.nodes),
                              agents=[node.name for node in self.cluster.nodes])
            early.start()
            try:
                # --retain: on a failure kind would delete its nodes itself, and a node's
                # anonymous /var volume (held by mounts that surfaced on the host) outlive
                # them; the step's undo (delete_cluster) deletes them, volumes included
                run(["kind", "create", "cluster", "--name", self.name, "--config",
                     str(self.state_dir / "kind-config.yaml"), "--kubeconfig",
                     str(self.kubeconfig), "--wait", "180s", "--retain"], env=env,
                    timeout=KIND_TIMEOUT)
            except CommandError as exc:
                early.cancel()
                if not self.image and "pull" in str(exc).lower():
                    raise RuntimeBackendError(
                        "cluster", "kind could not pull its default node image (no registry "
                        "here?): build one offline with scripts/build-kind-node-image or set "
                        f"SANDBOX_KIND_IMAGE to a local one; {exc}") from exc
                raise
            early.finish()  # errors here name the step "image"
            self.deploy_error = early.deploy_error

    def agent_and_plugins(self) -> None:
        """The agents' namespace and our device plugin, created together (the plugin finds
        the tree once the agent has mounted it; its mount sees the tree appear), unless the
        cluster step already did; then until every node serves its tree and, without the
        topology step, advertises."""
        api = api_client(self.kubeconfig)
        if self.facts.minimal:
            scale_coredns_to_zero(api)
        if self.deploy_error is not None:
            raise self.deploy_error
        if not self.deployed:
            self._deploy(api)
        self._wait_agents(api)
        if self.runtime.reference_plugin and not self.runtime.emulate_topology:
            self._wait_plugins(api)
        # else the topology step restarts the kubelets at once and waits for both: the
        # plugin registers again with each restarted kubelet anyway

    def _deploy(self, api: Kube) -> None:
        """The agents' namespace (their mirror pods need it) and, unless
        --no-device-plugin, our device plugin's DaemonSet."""
        plugin = self.runtime.reference_plugin
        self.progress("creating the agents' namespace " + (
            "and the reference device plugin" if plugin else
            "(no device plugin: --no-device-plugin)"))
        create(api, [agent_namespace()], "agent")  # for the agents' mirror pods
        if plugin:
            manifests = list(yaml.safe_load_all(find_plugin("hw-sandbox-device-plugin").text()))
            for doc in manifests:
                if doc and doc.get("kind") == "DaemonSet":
                    for container in doc["spec"]["template"]["spec"]["containers"]:
                        container["args"] = [*container.get("args", []),
                                             *self.runtime.plugin_options]
            create(api, manifests, "plugins")
        self.deployed = True

    def topology(self) -> None:
        """Each profile node's kubelet restarted on its emulated machine
        (``kindtopology``) as soon as its tree is served, then until each node is Ready
        with the emulated CPU count and, with our plugin, advertises its devices."""
        if not self.runtime.emulate_topology:
            return
        api = api_client(self.kubeconfig)
        self.progress("restarting the kubelets on the emulated CPUs, NUMA nodes and memory")
        targets = kind_nodes(api, [node.name for node in self.cluster.nodes])
        for node in self.cluster.nodes:
            kindtopology.write_node_files(self.nodes / node.name, node)
            settle = time.monotonic() + SETTLE_TIMEOUT
            while starting_pods(api, targets[node.name]) and time.monotonic() < settle:
                time.sleep(0.1)
            exec_in_node(targets[node.name], ["sh", "-c", kindtopology.RECONFIGURE],
                         "topology")
        want = {node.name: len(node.cpus) for node in self.cluster.nodes}
        devices = {node.name for node in self.cluster.nodes if self.runtime.reference_plugin
                   and advertisable(node, len(node.devices))}
        deadline = time.monotonic() + PLUGIN_TIMEOUT
        back: set[str] = set()  # Ready on the emulated machine, maybe not advertising yet
        while want:
            for item in api.items("/api/v1/nodes"):
                replica = labels(item).get(NODE_LABEL)
                if replica not in want:
                    continue
                capacity = item["status"].get("capacity") or {}
                advertised = {r: v for r, v in (item["status"].get("allocatable") or {}).items()
                              if ours(r) and int(v) > 0}
                if is_ready(item) and capacity.get("cpu") == str(want[replica]):
                    back.add(replica)
                    if ((advertised or replica not in devices)
                            and _serves_agent_log(api, targets[replica])):
                        self.progress(f"{replica}: kubelet sees cpu={capacity.get('cpu')}, "
                                      f"memory={capacity.get('memory')}" + "".join(
                                          f", {r}={v}" for r, v in sorted(advertised.items())))
                        del want[replica]
            if not want:
                return
            if devices & set(want):
                fail_on_broken_pods(api, "kube-system",
                                     "app.kubernetes.io/name=hw-sandbox-device-plugin", "plugins")
            if time.monotonic() > deadline:
                late = sorted(set(want) - back)
                if not late:
                    raise RuntimeBackendError(
                        "plugins", f"no extended resource on {', '.join(sorted(want))} within "
                        f"{PLUGIN_TIMEOUT:.0f}s; see `kubectl -n kube-system logs "
                        "-l app.kubernetes.io/name=hw-sandbox-device-plugin`")
                raise RuntimeBackendError(
                    "topology", f"{', '.join(late)}: the kubelet did not come back "
                    f"on the emulated machine within {PLUGIN_TIMEOUT:.0f}s; see `docker exec "
                    f"{targets[late[0]]} journalctl -u kubelet`")
            time.sleep(0.25)

    def _wait_agents(self, api: Kube) -> None:
        from sandbox.fakehw.control import ControlClient

        pending = {n.name for n in self.cluster.nodes}
        deadline = time.monotonic() + AGENT_TIMEOUT
        while pending:
            for node in sorted(pending):
                sock = self.nodes / node / "control.sock"
                if self.record.transport == "host" and not sock.exists():
                    continue
                with contextlib.suppress(SandboxError, OSError):
                    with self.runtime.reach(self.state_dir, node, sock) as path, \
                            ControlClient(path, timeout=2) as client:
                        client.devices()
                    pending.discard(node)
                    self.progress(f"{node}: fake hardware served")
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

    def _wait_plugins(self, api: Kube) -> None:
        want = {n.name for n in self.cluster.nodes if advertisable(n, len(n.devices))}
        deadline = time.monotonic() + PLUGIN_TIMEOUT
        while want:
            for item in api.items("/api/v1/nodes"):
                replica = labels(item).get(NODE_LABEL)
                capacity = item["status"].get("capacity") or {}
                if replica in want and any(ours(r) and int(v) > 0 for r, v in capacity.items()):
                    want.discard(replica)
                    self.progress(f"{replica}: kubelet advertises "
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


def steps(state_dir: Path, progress: Progress, up: KindUp | None = None) -> list[Step]:
    """``up``'s steps (with their ``do``s when given a ``KindUp``); ``down`` undoes the
    same list: deleting the cluster removes the agents and plugins with it."""

    def delete_cluster() -> None:
        record = read_record(state_dir) or SandboxRecord()
        if record.kind_cluster:
            progress(f"deleting kind cluster {record.kind_cluster}")
            delete_kind_cluster(record.kind_cluster)
        if record.network:
            with contextlib.suppress(Exception):
                docker_client().networks.get(record.network).remove()

    def unmount_all() -> None:
        # The nodes' FUSE mounts propagated here (their servers died with the nodes), and
        # the shared bind mount the config step made.
        unmount(mounts_under(state_dir))

    named = [Step("preflight"), Step("config", undo=unmount_all),
             Step("cluster", undo=delete_cluster), Step("agent"), Step("topology")]
    if up is None:
        return named
    dos = [up.preflight, up.config, up.cluster_and_image, up.agent_and_plugins, up.topology]
    return [replace(step, do=do) for step, do in zip(named, dos, strict=True)]
