"""The ``native`` runtime: a real single-node Kubernetes run as host processes.

No registry serves kind node images here, so this backend runs components built from
source by ``scripts/build-k8s`` (kept in ``${HWSANDBOX_CACHE:-~/.cache/hw-sandbox}/k8s/
v<version>/bin``), containerd 2.x with CDI built by ``scripts/build-containerd``
(``.../containerd/v<version>/bin``), plus Debian's runc and CNI plugins. ``up`` starts, as
detached processes with pid files and logs under ``state_dir``::

    etcd -> kube-apiserver -> kube-controller-manager, kube-scheduler
         -> node tree (FUSE mount + device nodes) -> containerd -> kubelet
         -> reference device plugin [-> reference DRA driver, ``dra_driver=True``]

It owns: certificates (``openssl`` CLI), kubeconfigs (``state_dir/kubeconfig`` is the
admin's), the containerd and kubelet configs, the CNI config (bridge ``hwsb0`` +
host-local; containerd adds loopback), the local pause and busybox images
(``sandbox.images.pause``).
The fake hardware comes from ``sandbox.agent`` (``prepare_node_tree``): the kubelet sees the
tree's CPUs, NUMA nodes and memory in a mount namespace of its own
(``sandbox.runtimes.kubeletns``), containerd runs runc through the cpuset mapper
(``sandbox.runtimes.cpumap``); device plugins read the FUSE tree; containerd sees the node's device
nodes (``state_dir/dev``, all 1:3, plus the fake /dev's relative symlinks such as
``dri/by-path``) under its /dev through an overlay in its own mount namespace
(``_with_node_dev``), so the host's /dev is never written.

Only the profile's FIRST node is run; the Kubernetes node name is its ``NodeSpec.name``.
The kubelet's root dir is ``/var/lib/kubelet`` (``HWSANDBOX_KUBELET_ROOT`` overrides; the
kubelet serves device plugins at ``/var/lib/kubelet/device-plugins/kubelet.sock`` whatever
its root dir); only one native sandbox can run on a machine at a time.

``up`` runs named steps (``native.steps``: certificates, etcd, kube-apiserver,
controllers, node tree, containerd, images, kubelet, device plugin, DRA driver, node
Ready); a failed step undoes the ones before it and is named in the error. ``down``
undoes every step in reverse, then removes what is left on the host (``native.cleanup``):
pods' network namespaces, every mount below the kubelet root and the state dir, kubelet
cgroups, sysctls the kubelet changed, the bridge, the directories ``up`` created (whole
only where it marked them as its own) and the state dir itself.

Modules: ``common`` (paths, constants, processes through ``sandbox.supervisor``), ``pki``,
``configs``, ``node`` (the fake hardware and the plugins on it), ``steps``, ``cleanup``,
``k8s`` (API reads). Docs: ``docs/native-runtime.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from sandbox.cache import CONTAINERD_TOOLS, CONTAINERD_VERSION
from sandbox.commands import run
from sandbox.errors import RuntimeBackendError, SandboxError
from sandbox.images.pause import BUSYBOX
from sandbox.profile.spec import Cluster
from sandbox.progress import Progress
from sandbox.runtimes import kubeletns
from sandbox.runtimes.base import (
    SandboxStatus,
    add_devices,
    add_pod_resources,
    remove_marked_dir,
    remove_state_dir,
)
from sandbox.runtimes.native.cleanup import (
    CREATED_MARKER,
    host_cleanup,
    mounts_below,
    shim_pids,
    sysctl,
)
from sandbox.runtimes.native.common import (
    BUILD_HINT,
    BUSYBOX_REF,
    CNI_BIN_DIR,
    CNI_PLUGINS,
    CONTAINERD_BUILD_HINT,
    DEVICE_PLUGINS_DIR,
    DRA_DRIVER_ENV,
    HOST_TOOLS,
    K8S_VERSION,
    KUBELET_SYSCTLS,
    Layout,
    bin_dir,
    cache_dir,
    containerd_bin_dir,
    ctr,
    free_ports,
    host_ip,
    http_ok,
    kubelet_root,
    running,
    spawn,
    stop,
    wait_for,
)
from sandbox.runtimes.native.configs import cni_config, containerd_config, kubelet_config
from sandbox.runtimes.native.k8s import kubelet_running, node_status
from sandbox.runtimes.native.steps import Up, down_steps, up_steps
from sandbox.runtimes.record import NodeRecord, SandboxRecord, read_record, write_record
from sandbox.runtimes.steps import run_steps, undo_steps

__all__ = [
    "BUILD_HINT", "BUSYBOX_REF", "DRA_DRIVER_ENV", "K8S_VERSION", "Layout", "NativeRuntime",
    "bin_dir", "cache_dir", "cni_config", "containerd_bin_dir", "containerd_config", "ctr",
    "kubelet_config", "kubelet_root",
    "mounts_below", "running", "shim_pids",
]


# The file ``_save_logs`` puts in the copy of a failed start's logs: only a directory
# with it is ever replaced.
FAILED_LOGS_MARKER = ".hw-sandbox-failed-logs"


# containerd refuses a unix socket path longer than this (its ttrpc socket is the longest
# under the state dir)
MAX_SOCKET_PATH = 104


def _recorded_kubelet_root(state_dir: Path) -> Path:
    """The kubelet root dir the sandbox in ``state_dir`` was brought up with."""
    record = read_record(state_dir) or SandboxRecord()
    return Path(record.kubelet_root or str(kubelet_root()))


class NativeRuntime:
    """Real etcd, kube-apiserver, controller-manager, scheduler, containerd and kubelet."""

    name = "native"

    def __init__(self, feature_gates: dict[str, bool] | None = None,
                 reference_plugin: bool = True, dra_driver: bool | None = None,
                 dra_options: Sequence[str] = (), plugin_options: Sequence[str] = (),
                 emulate_topology: bool = True) -> None:
        self.feature_gates = dict(feature_gates or {})
        # False (`sandbox up --kubelet-topology host`): the kubelet sees the host's machine
        self.emulate_topology = emulate_topology
        # more flags for the reference device plugin (e.g. --pre-start-required)
        self.plugin_options: tuple[str, ...] = tuple(plugin_options)
        # more flags for the reference DRA driver (e.g. --compatibility-groups)
        self.dra_options = list(dra_options)
        # False: no hwplugins.deviceplugin on the node, so a third-party plugin under test
        # is the only one serving its resource (e.g. gpu.intel.com/i915)
        self.reference_plugin = reference_plugin
        # True: also run the reference DRA driver (hwplugins.dra) on the node. Off by
        # default (the CLI's `sandbox up --runtime native` takes HWSANDBOX_NATIVE_DRA=1).
        if dra_driver is None:
            dra_driver = os.environ.get(DRA_DRIVER_ENV, "") == "1"
        self.dra_driver = dra_driver

    # -- checks ------------------------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        if os.geteuid() != 0:
            return "the native runtime needs root (it runs a kubelet and containerd)"
        missing = [b for b in ("etcd", "kube-apiserver", "kube-controller-manager",
                               "kube-scheduler", "kubelet") if not (bin_dir() / b).is_file()]
        if missing:
            return f"missing {', '.join(missing)} in {bin_dir()} ({BUILD_HINT})"
        built = [t for t in CONTAINERD_TOOLS if not (containerd_bin_dir() / t).is_file()]
        if built:
            return (f"missing {', '.join(built)} (containerd v{CONTAINERD_VERSION}, with CDI) in "
                    f"{containerd_bin_dir()} ({CONTAINERD_BUILD_HINT})")
        tools = [t for t in HOST_TOOLS if shutil.which(t) is None]
        plugins = [p for p in CNI_PLUGINS if not (CNI_BIN_DIR / p).is_file()]
        if tools or plugins:
            what = tools + [f"{CNI_BIN_DIR}/{p}" for p in plugins]
            return f"missing {', '.join(what)} ({BUILD_HINT}; it installs the Debian packages)"
        if shutil.which("fusermount3") is None:
            return "missing fusermount3 for the node's FUSE tree (run scripts/install-system-deps)"
        if not BUSYBOX.is_file() or shutil.which("gcc") is None:
            return f"missing busybox-static or gcc ({BUILD_HINT})"
        if kubelet_running():
            return "another native sandbox is running on this machine (one kubelet per host)"
        return None

    # -- up -----------------------------------------------------------------------------
    def up(self, cluster: Cluster, profile_path: str, state_dir: Path, progress: Progress) -> None:
        reason = self.unavailable_reason()
        if reason:
            raise RuntimeBackendError("check", reason)
        if not cluster.nodes:
            raise RuntimeBackendError("check", "the profile has no nodes")
        node = cluster.nodes[0]
        if len(cluster.nodes) > 1:
            progress(f"native runtime runs only the first node ({node.name}); "
                     f"ignoring {len(cluster.nodes) - 1} more")
        layout = Layout(state_dir)
        longest = f"{layout.containerd_sock}.ttrpc"
        if len(longest) > MAX_SOCKET_PATH:
            raise RuntimeBackendError(
                "check", f"the state dir {state_dir} is too deep for containerd's sockets "
                f"({longest} has {len(longest)} characters, at most {MAX_SOCKET_PATH}): set "
                "HWSANDBOX_STATE_DIR to a shorter directory")
        problem = (kubeletns.policy_problem(node, node.cpu_manager_policy)
                   if self.emulate_topology else None)
        if problem:
            raise RuntimeBackendError("check", problem)
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        root = kubelet_root()
        if (root / CREATED_MARKER).is_file() and not mounts_below(root):
            # made by a native sandbox that is gone (no kubelet runs: checked above) and not
            # removed by a `down` (killed, say): its plugins' sockets would look registered
            # to this kubelet and to `sandbox fault restart-kubelet`'s count. Made afresh
            # below, as this sandbox's own.
            progress(f"removing {root}, left by an earlier native sandbox that is gone")
            shutil.rmtree(root)
        ip = host_ip()
        ports = free_ports(("etcd", "etcd-peer", "apiserver", "controller-manager",
                            "scheduler", "kubelet", "kubelet-healthz"))
        record = SandboxRecord(
            runtime=self.name,
            profile=profile_path,
            cluster=cluster.name,
            name=state_dir.name,
            # same shape as the local runtime's: `sandbox fault` finds the control socket
            nodes={node.name: NodeRecord(
                root=str(state_dir / "node-root"),
                socket=str(state_dir / "node" / "control.sock"),
                kubelet_dir=str(DEVICE_PLUGINS_DIR),
            )},
            version=K8S_VERSION,
            # the admin kubeconfig (pki step), as the kind runtime records its own: what
            # `sandbox plugins deploy` and `sandbox dra claims` talk to the API server with
            kubeconfig=str(layout.kubeconfig),
            bin_dir=str(bin_dir()),
            ports=ports,
            host_ip=ip,
            kubelet_root=str(root),
            # containerd (1.6 and 2.4) puts shim sockets in /run/containerd/s whatever its state dir
            created_paths=tuple(str(p) for p in (root, DEVICE_PLUGINS_DIR.parent,
                                                 Path("/var/log/containers"), Path("/var/lib/cni"),
                                                 Path("/run/containerd")) if not p.exists()),
            sysctls={k: sysctl(k) for k in KUBELET_SYSCTLS},
            netns=(),
            dra_driver=self.dra_driver,
            containerd=CONTAINERD_VERSION,
            feature_gates=self.feature_gates,
            dra_options=tuple(self.dra_options),
        )
        write_record(state_dir, record)
        if not root.exists():  # ours alone: down removes it whole
            root.mkdir(parents=True, mode=0o700)
            (root / CREATED_MARKER).write_text("made by `sandbox up --runtime native`\n")
        up = Up(layout, node, ports, ip, root, self.feature_gates, progress, self.dra_options,
                self.plugin_options, self.emulate_topology)
        try:
            run_steps(up_steps(up, self.reference_plugin, self.dra_driver), progress)
        except BaseException:
            progress("up failed (its logs are kept in a copy: see below)")
            self._save_logs(layout, progress)
            raise

    def _save_logs(self, layout: Layout, progress: Progress) -> None:
        """Copy the logs to ``<state>.failed-logs`` (beside the state dir, which ``down``
        removes), marked as ours: the copy a previous failed start left is replaced, a
        directory of that name that is not ours is left alone."""
        if not layout.logs.is_dir():
            return
        keep = layout.state.with_name(layout.state.name + ".failed-logs")
        try:
            remove_marked_dir(keep, FAILED_LOGS_MARKER)
            keep.mkdir(mode=0o700)
            (keep / FAILED_LOGS_MARKER).write_text(
                "logs of a failed `sandbox up`; the next failed start replaces them\n")
            shutil.copytree(layout.logs, keep, symlinks=True, dirs_exist_ok=True)
        except (SandboxError, OSError) as exc:
            progress(f"logs of the failed start not copied to {keep}: {exc}")
            return
        progress(f"logs of the failed start: {keep}")

    # -- down ---------------------------------------------------------------------------
    def down(self, state_dir: Path, progress: Progress) -> None:
        layout = Layout(state_dir)
        problems = undo_steps(down_steps(layout, progress), progress)
        record = read_record(state_dir) or SandboxRecord()
        problems += host_cleanup(layout, record, progress)
        if problems:
            raise RuntimeBackendError("down", "; ".join(problems))
        try:
            remove_state_dir(state_dir)
        except (SandboxError, OSError) as exc:
            raise RuntimeBackendError("down", str(exc)) from exc

    # -- kubelet restart ----------------------------------------------------------------
    def restart_kubelet(self, state_dir: Path, node: str) -> None:
        layout = Layout(state_dir)
        record = read_record(state_dir) or SandboxRecord()
        if node not in record.nodes or not record.ports:
            raise RuntimeBackendError("restart kubelet", f"no node {node!r} in {state_dir}")
        argv = json.loads((layout.run / "kubelet.argv.json").read_text())
        stop(layout, "kubelet")
        spawn(layout, "kubelet", argv)
        healthz = f"http://127.0.0.1:{record.ports['kubelet-healthz']}/healthz"
        wait_for(layout, "kubelet", "healthy", lambda: http_ok(healthz), 120)

    def registered_plugins(self, state_dir: Path, node: str) -> frozenset[str]:
        """The sockets plugins have (re)made for the kubelet: on start the kubelet deletes
        every socket in device-plugins/ but its own, and a plugin that registers again
        makes its socket again; DRA drivers register through plugins_registry/."""
        root = _recorded_kubelet_root(state_dir)
        found = set()
        for sub, where in (("device-plugins", DEVICE_PLUGINS_DIR),
                           ("plugins_registry", root / "plugins_registry")):
            with contextlib.suppress(OSError):
                found |= {f"{sub}/{p.name}" for p in where.iterdir()
                          if p.is_socket() and p.name != "kubelet.sock"}
        return frozenset(found)

    def pod_resources_socket(self, state_dir: Path, node: str) -> Path | None:
        return _recorded_kubelet_root(state_dir) / "pod-resources" / "kubelet.sock"

    def reach(self, state_dir: Path, node: str, socket: Path) -> AbstractContextManager[Path]:
        return nullcontext(socket)  # host processes: their sockets are this host's

    # -- images -------------------------------------------------------------------------
    def load_images(self, state_dir: Path, images: Sequence[str], archives: Sequence[Path],
                    progress: Progress) -> None:
        """``ctr images import`` into the node's containerd, namespace k8s.io (the CRI's);
        a Docker image is saved to a tar in the state dir first (``docker save``)."""
        layout = Layout(state_dir)
        if not layout.containerd_sock.is_socket():
            raise SandboxError(f"sandbox {state_dir.name!r}: its containerd is not running "
                               f"(no {layout.containerd_sock}); is the sandbox up?")
        if images and shutil.which("docker") is None:
            raise SandboxError("loading a Docker image needs the docker CLI and daemon; "
                               "without them, give an image archive: --archive FILE.tar")
        importing = [*ctr(layout), "images", "import"]
        for archive in archives:
            progress(f"loading {archive} into the node's containerd")
            run([*importing, str(archive)], timeout=None, step=f"load {archive}")
        for image in images:
            progress(f"loading {image} into the node's containerd (docker save, ctr import)")
            with tempfile.TemporaryDirectory(prefix="load-", dir=state_dir) as tmp:
                tar = Path(tmp) / "image.tar"
                run(["docker", "save", "-o", str(tar), image], timeout=None,
                    step=f"load {image}")
                run([*importing, str(tar)], timeout=None, step=f"load {image}")

    # -- status -------------------------------------------------------------------------
    def status(self, state_dir: Path) -> SandboxStatus:
        layout = Layout(state_dir)
        record = read_record(state_dir)
        if record is None:
            raise RuntimeBackendError("status", f"no sandbox in {state_dir}")
        result = SandboxStatus(name=record.cluster or state_dir.name,
                               runtime=self.name, profile=record.profile)
        for name, info in record.nodes.items():
            node = node_status(layout, name)
            if not add_devices(node, Path(info.socket)):
                node.down.append("fake hardware server")
            add_pod_resources(node, self.pod_resources_socket(state_dir, name))
            result.nodes.append(node)
        return result


