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
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from sandbox.catalog import find_plugin
from sandbox.errors import CommandError, ControlError, RuntimeBackendError, SandboxError
from sandbox.profile import spec
from sandbox.profile.spec import Cluster
from sandbox.runtimes import agentimage
from sandbox.runtimes.agentimage import PRELOADED_LABEL
from sandbox.runtimes.base import (
    NodeStatus,
    Progress,
    ResourceStatus,
    SandboxStatus,
    device_statuses,
    read_record,
    remove_state_dir,
    write_record,
)
from sandbox.runtimes.imagefiles import cache_root
from sandbox.runtimes.kindapi import (
    AGENT_NAMESPACE,
    SPEC_FILE,
    agent_manifests,
    api_client,
    create,
    fail_on_broken_pods,
    ours,
    scale_coredns_to_zero,
)
from sandbox.runtimes.kindconfig import NODE_LABEL, HostFacts, kind_config_text
from sandbox.runtimes.kindimage import KIND_VERSION, NODE_IMAGE, SHAPE_LABEL

AGENT_TIMEOUT = 180.0
PLUGIN_TIMEOUT = 120.0


def _run(argv: list[str], step: str, *, input_text: str | None = None,
         env: dict[str, str] | None = None, timeout: float = 900) -> str:
    try:
        result = subprocess.run(argv, input=input_text, capture_output=True, text=True,
                                check=False, env=env, timeout=timeout)
    except FileNotFoundError as exc:
        raise RuntimeBackendError(step, f"{argv[0]} not found") from exc
    except subprocess.TimeoutExpired as exc:
        raise RuntimeBackendError(step, f"{' '.join(argv[:3])} did not finish in "
                                  f"{timeout:.0f}s") from exc
    if result.returncode != 0:
        err = CommandError(argv, result.returncode, result.stdout + result.stderr)
        lines = [line.strip() for line in err.output.splitlines() if line.strip()]
        said = " | ".join(lines[-2:]) or "no output"
        raise RuntimeBackendError(step, f"`{' '.join(argv[:3])}` exited {result.returncode}: "
                                  f"{said}") from err
    return result.stdout


def _docker() -> Any:
    import docker

    return docker.from_env(timeout=30)


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

def _local_docker() -> bool:
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
                     restrict_oom=_local_docker() and _caps_missing(),
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


# --- the runtime ------------------------------------------------------------------------------

class KindRuntime:
    name = "kind"

    def node_image(self) -> tuple[str, bool]:
        """(image, present locally): SANDBOX_KIND_IMAGE, else our built one if present,
        else ("", False): kind's default, pulled by kind."""
        explicit = os.environ.get("SANDBOX_KIND_IMAGE")
        candidate = explicit or NODE_IMAGE
        try:
            _docker().images.get(candidate)
        except Exception:  # noqa: BLE001 - not present
            return (explicit, False) if explicit else ("", False)
        return candidate, True

    def unavailable_reason(self) -> str | None:
        if shutil.which("kind") is None:
            return _no_kind()
        try:
            _docker().ping()
        except Exception as exc:  # noqa: BLE001 - any failure means: no usable daemon
            return f"no Docker daemon reachable ({type(exc).__name__}; is dockerd running?)"
        image, present = self.node_image()
        if image and not present:
            return (f"SANDBOX_KIND_IMAGE={image} is not present locally "
                    "(docker pull it, or build one with scripts/build-kind-node-image)")
        return None

    def up(self, cluster: Cluster, profile_path: str, state_dir: Path,
           progress: Progress) -> None:
        name = state_dir.name
        client = _docker()
        # -- preflight
        clusters = _run(["kind", "get", "clusters"], "preflight").split()
        if name in clusters:
            raise RuntimeBackendError(
                "preflight", f"a kind cluster named {name!r} already exists (not this "
                f"sandbox's); delete it with `kind delete cluster --name {name}` or pick "
                "another --name")
        image, present = self.node_image()
        if not present and os.environ.get("SANDBOX_KIND_IMAGE"):
            raise RuntimeBackendError(
                "preflight", f"node image {image} is not present locally (docker pull it, or "
                "build one offline with scripts/build-kind-node-image)")
        nodes = state_dir / "nodes"
        record: dict[str, Any] = {"name": name, "runtime": self.name, "profile": profile_path,
                                  "created": time.time(), "nodes": {}, "image": image}
        for node in cluster.nodes:
            record["nodes"][node.name] = {"root": str(nodes / node.name / "root"),
                                          "socket": str(nodes / node.name / "control.sock")}
        write_record(state_dir, record)
        for node in cluster.nodes:  # bind-mounted at STATE_IN_NODE in the node container
            (nodes / node.name).mkdir(parents=True, exist_ok=True)
            (nodes / node.name / SPEC_FILE).write_text(spec.dump(node))
        # -- config
        facts = host_facts(client, image) if image else HostFacts(
            cgroup_v1=str(client.info().get("CgroupVersion", "2")) == "1",
            restrict_oom=_local_docker() and _caps_missing())
        config = state_dir / "kind-config.yaml"
        config.write_text(kind_config_text(cluster, name, state_dir, image or None, facts))
        if _local_docker() and _propagation(nodes) not in ("shared", "shared,slave"):
            # Bidirectional extraMounts need a shared mount on the host side.
            _run(["mount", "--bind", str(nodes), str(nodes)], "config")
            record["bind_mount"] = str(nodes)
            write_record(state_dir, record)
            _run(["mount", "--make-rshared", str(nodes)], "config")
        # -- cluster
        kubeconfig = state_dir / "kubeconfig"
        record.update(kind_cluster=name, kubeconfig=str(kubeconfig), network=network_name(name))
        write_record(state_dir, record)
        shape = "minimal shape: static CNI, no CoreDNS" if facts.minimal else ""
        progress(f"creating kind cluster {name}: {len(cluster.nodes)} node(s), image "
                 f"{image or 'kind default'}{f' ({shape})' if shape else ''}")
        env = {**os.environ, "KIND_EXPERIMENTAL_DOCKER_NETWORK": network_name(name)}
        # The sandbox image is built and loaded while kind creates the cluster (unpacking
        # it in the nodes is the slow part); if that fails it is loaded again afterwards.
        with tempfile.TemporaryDirectory(prefix="hwsb-image-") as work:
            early = _EarlyLoad(name, client, image, Path(work), progress)
            early.start()
            try:
                _run(["kind", "create", "cluster", "--name", name, "--config", str(config),
                      "--kubeconfig", str(kubeconfig), "--wait", "180s"], "cluster", env=env)
            except RuntimeBackendError as exc:
                early.cancel()
                if not image and "pull" in exc.message.lower():
                    raise RuntimeBackendError(
                        "cluster", "kind could not pull its default node image (no registry "
                        "here?): build one offline with scripts/build-kind-node-image or set "
                        f"SANDBOX_KIND_IMAGE to a local one; {exc.message}") from exc
                raise
            # -- image
            early.finish()
        api = api_client(kubeconfig)
        if facts.minimal:
            scale_coredns_to_zero(api)
        # -- agent, plugins: created together (the plugin rescans every second and finds
        # the tree once the agent has mounted it; its mount sees the tree appear)
        progress("deploying the fake-hardware agent and the reference device plugin")
        docs = agent_manifests(cluster)
        create(api, docs, "agent")
        create(api, list(yaml.safe_load_all(find_plugin("hw-sandbox-device-plugin").text())),
                "plugins")
        self._wait_agents(api, cluster, state_dir, progress)
        self._wait_plugins(api, cluster, progress)

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
        record = read_record(state_dir) or {}
        problems: list[str] = []
        cluster = record.get("kind_cluster")
        if cluster:
            progress(f"deleting kind cluster {cluster}")
            try:
                _run(["kind", "delete", "cluster", "--name", cluster], "down")
            except RuntimeBackendError as exc:
                problems.append(exc.message)
        network = record.get("network")
        if network:
            with contextlib.suppress(Exception):
                _docker().networks.get(network).remove()
        # The nodes' FUSE mounts propagated here; their servers died with the nodes.
        for mount in _mounts_under(state_dir):
            result = subprocess.run(["umount", "-l", mount], capture_output=True, text=True,
                                    check=False)
            if result.returncode != 0 and os.path.ismount(mount):
                problems.append(f"cannot unmount {mount}: {result.stderr.strip()}")
        if problems:
            raise RuntimeBackendError("down", "; ".join(problems))
        try:
            remove_state_dir(state_dir)
        except SandboxError as exc:
            raise RuntimeBackendError("down", str(exc)) from exc

    def status(self, state_dir: Path) -> SandboxStatus:
        from sandbox.fakehw.control import ControlClient

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
            node = NodeStatus(replica or item.metadata.name, ready=any(
                c.type == "Ready" and c.status == "True" for c in item.status.conditions or []))
            cap, alloc = item.status.capacity or {}, item.status.allocatable or {}
            for res, value in sorted(cap.items()):
                if ours(res):
                    node.resources.append(ResourceStatus(res, int(value),
                                                         int(alloc.get(res, 0))))
            info = replicas.get(replica)
            if info is not None:
                try:
                    with ControlClient(Path(info["socket"]), timeout=5) as client:
                        devices = client.devices()
                except (SandboxError, OSError) as exc:
                    node.notes.append(f"fake hardware server not answering: {exc}")
                    devices = {}
                node.devices.extend(device_statuses(devices))
            out.nodes.append(node)
        return out

    def restart_kubelet(self, state_dir: Path, node: str) -> None:
        target = self._kind_node_for(state_dir, node)
        try:
            result = _docker().containers.get(target).exec_run(
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
            result = _docker().containers.get(target).exec_run(["sh", "-c", script])
        except Exception as exc:  # noqa: BLE001 - docker raises many types
            raise ControlError(f"{node}: cannot list the kubelet's plugin sockets: {exc}") from exc
        return frozenset(result.output.decode(errors="replace").split())

    def _kind_node_for(self, state_dir: Path, node: str) -> str:
        record = read_record(state_dir) or {}
        kubeconfig = record.get("kubeconfig")
        if not kubeconfig:
            raise SandboxError(f"sandbox {state_dir.name!r} has no kubeconfig")
        items = api_client(Path(kubeconfig)).list_node(label_selector=f"{NODE_LABEL}={node}").items
        if not items:
            raise SandboxError(f"no kind node carries {NODE_LABEL}={node}")
        return str(items[0].metadata.name)


class _EarlyLoad(threading.Thread):
    """Build the sandbox image and ``kind load`` it as soon as the nodes can take it: once
    kubeadm init has begun on the control plane, kind has finished restarting every
    node's containerd (its config action runs first). ``finish`` waits for it, and loads
    again the ordinary way if the early load failed or never started."""

    def __init__(self, cluster: str, client: Any, node_image: str, work: Path,
                 progress: Progress) -> None:
        super().__init__(name="hwsb-early-load", daemon=True)
        self.cluster, self.client, self.node_image = cluster, client, node_image
        self.work, self.progress = work, progress
        self.cancelled = threading.Event()
        self.agent: agentimage.AgentImage | None = None
        self.error: BaseException | None = None
        self.loaded = False

    def cancel(self) -> None:
        self.cancelled.set()
        self.join(timeout=30)

    def _preloaded(self) -> frozenset[str]:
        if not self.node_image:
            return frozenset()
        try:
            labels = self.client.images.get(self.node_image).labels or {}
        except Exception:  # noqa: BLE001 - no labels: ship every layer
            return frozenset()
        return frozenset(filter(None, labels.get(PRELOADED_LABEL, "").split(",")))

    def _load(self) -> None:
        assert self.agent is not None
        if self.agent.archive is not None:
            _run(["kind", "load", "image-archive", str(self.agent.archive), "--name",
                  self.cluster], "image")
        else:
            _run(["kind", "load", "docker-image", self.agent.ref, "--name", self.cluster],
                 "image")

    def run(self) -> None:
        try:
            self.agent = agentimage.build(self.progress, self.work, self._preloaded())
            control_plane = f"{self.cluster}-control-plane"
            while not self.cancelled.is_set():
                with contextlib.suppress(Exception):
                    done = self.client.containers.get(control_plane).exec_run(
                        ["test", "-e", "/etc/kubernetes/manifests/kube-apiserver.yaml"])
                    if done.exit_code == 0:
                        break
                self.cancelled.wait(0.5)
            else:
                return
            self.progress(f"loading {agentimage.IMAGE} into the node(s) while kubeadm runs "
                          f"({self.agent.shipped})")
            self._load()
            self.loaded = True
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self.error = exc

    def finish(self) -> None:
        self.join()
        if self.loaded:
            return
        if self.agent is None and self.error is not None:
            raise self.error  # building the image failed: trying again cannot help
        if self.agent is None:
            self.agent = agentimage.build(self.progress, self.work, self._preloaded())
        self.progress(f"loading {agentimage.IMAGE} into the node(s) ({self.agent.shipped})")
        self._load()
