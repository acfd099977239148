"""``up`` and ``down`` of the native runtime as ordered, named steps (``runtimes.steps``).

``up_steps`` needs the node and the ports chosen for this sandbox; ``down_steps`` needs
only the state dir, so a later ``sandbox down`` (another process) undoes the same steps.
Each undo finds nothing to do for a step that never ran.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import yaml

from sandbox import supervisor
from sandbox.commands import run
from sandbox.errors import RuntimeBackendError
from sandbox.images.pause import busybox_image, pause_image
from sandbox.profile.spec import NodeSpec
from sandbox.progress import Progress
from sandbox.runtimes import cpumap, kubeletns
from sandbox.runtimes.native.cleanup import as_proc, remove_containers, shim_pids
from sandbox.runtimes.native.common import (
    BUSYBOX_REF,
    DEVICE_CHECKPOINT,
    DEVICE_PLUGINS_DIR,
    PAUSE_REF,
    Layout,
    bin_dir,
    cache_dir,
    containerd_bin_dir,
    ctr,
    http_ok,
    spawn,
    stop,
    wait_for,
)
from sandbox.runtimes.native.configs import (
    apiserver_argv,
    cni_config,
    containerd_config,
    etcd_argv,
    gate_flags,
    kubelet_config,
    scheduler_argv,
)
from sandbox.runtimes.native.k8s import default_service_account, node_ready
from sandbox.runtimes.native.node import (
    prepare_node_tree,
    start_dra_driver,
    start_node_plugins,
    start_plugin_netns,
    with_node_dev,
)
from sandbox.runtimes.native.pki import make_pki, write_kubeconfig
from sandbox.runtimes.record import read_record, write_record
from sandbox.runtimes.steps import Step


class Up:
    """What one ``up`` works with, and its steps' ``do``s."""

    def __init__(self, layout: Layout, node: NodeSpec, ports: dict[str, int],
                 host_ip: str, root: Path, feature_gates: dict[str, bool],
                 progress: Progress, dra_options: Sequence[str] = (),
                 plugin_options: Sequence[str] = (), emulate_topology: bool = True) -> None:
        self.layout, self.node = layout, node
        self.ports, self.host_ip, self.root = ports, host_ip, root
        self.feature_gates, self.progress = feature_gates, progress
        self.dra_options = tuple(dra_options)
        self.plugin_options = tuple(plugin_options)
        self.emulate_topology = emulate_topology
        self.bin = bin_dir()
        self.server = f"https://127.0.0.1:{ports['apiserver']}"
        self.t0 = time.monotonic()

    def certificates(self) -> None:
        """A CA, the components' certificates and kubeconfigs."""
        self.progress("certificates")
        make_pki(self.layout.pki, self.node.name, self.host_ip)
        write_kubeconfig(self.layout.kubeconfig, self.server, self.layout.pki, "admin",
                         "hw-sandbox")
        for user in ("controller-manager", "scheduler", "kubelet"):
            write_kubeconfig(self.layout.state / f"{user}.kubeconfig", self.server,
                             self.layout.pki, user, "hw-sandbox")

    def etcd(self) -> None:
        """etcd, until healthy."""
        self.progress("etcd")
        etcd_url = f"http://127.0.0.1:{self.ports['etcd']}"
        spawn(self.layout, "etcd", etcd_argv(self.bin, self.layout.state / "etcd",
                                             self.ports["etcd"], self.ports["etcd-peer"]))
        wait_for(self.layout, "etcd", "healthy",
                 lambda: http_ok(f"{etcd_url}/health", expect='"health":"true"'), 60)

    def apiserver(self) -> None:
        """kube-apiserver, until ready."""
        self.progress("kube-apiserver")
        pki = self.layout.pki
        spawn(self.layout, "kube-apiserver", [
            *apiserver_argv(self.bin, pki, self.ports["etcd"], self.ports["apiserver"],
                            self.layout.state / "apiserver-certs", self.feature_gates),
            "--bind-address=0.0.0.0", f"--advertise-address={self.host_ip}",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            # The node name (gpu-worker) does not resolve; reach the kubelet by its IP.
            "--kubelet-preferred-address-types=InternalIP",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
        ])
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        wait_for(self.layout, "kube-apiserver", "ready",
                 lambda: http_ok(f"{self.server}/readyz", ctx), 120)

    def controllers(self) -> None:
        """kube-controller-manager and kube-scheduler, until healthy."""
        pki = self.layout.pki
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        self.progress("kube-controller-manager, kube-scheduler")
        kcm_cfg = str(self.layout.state / "controller-manager.kubeconfig")
        spawn(self.layout, "kube-controller-manager", [
            str(self.bin / "kube-controller-manager"), f"--kubeconfig={kcm_cfg}",
            f"--authentication-kubeconfig={kcm_cfg}", f"--authorization-kubeconfig={kcm_cfg}",
            "--bind-address=127.0.0.1", f"--secure-port={self.ports['controller-manager']}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            "--controllers=*,bootstrapsigner,tokencleaner", "--cluster-name=hw-sandbox",
            # default /usr/libexec/kubernetes/...: it would create it on the host
            f"--flex-volume-plugin-dir={self.layout.state / 'flex-volume-plugins'}",
            *gate_flags(self.feature_gates),
        ])
        spawn(self.layout, "kube-scheduler", scheduler_argv(
            self.bin, self.layout.state / "scheduler.kubeconfig", self.ports["scheduler"],
            self.feature_gates))
        wait_for(self.layout, "kube-controller-manager", "healthy", lambda: http_ok(
            f"https://127.0.0.1:{self.ports['controller-manager']}/healthz", insecure), 60)
        wait_for(self.layout, "kube-scheduler", "healthy", lambda: http_ok(
            f"https://127.0.0.1:{self.ports['scheduler']}/healthz", insecure), 60)

    def node_tree(self) -> None:
        """The node's fake /sys, /dev, /proc and its device nodes for containerd."""
        prepare_node_tree(self.layout, self.node, self.progress)

    def plugin_netns(self) -> None:
        """The node's plugin network namespace with the tree's netdevs as links."""
        start_plugin_netns(self.layout, self.progress)

    def containerd(self) -> None:
        """containerd (seeing the node's device nodes), until serving."""
        self.progress("containerd")
        lay = self.layout
        self._share_kubelet_root()
        # the node's tree too: containerd's copy is then a slave, as a pod's hostPath into
        # it with HostToContainer propagation needs (bundled manifests mount
        # /var/lib/hw-sandbox/root so, a link to it made by `sandbox plugins deploy`)
        run(["mount", "--make-shared", str(lay.state / "node-root")])
        for d in (lay.containerd, lay.cni / "net.d", lay.cdi, lay.cdi_plugins, lay.kubelet,
                  lay.nri):
            d.mkdir(parents=True, exist_ok=True)
        runc = shutil.which("runc")
        if runc is None:
            raise RuntimeBackendError("containerd", "runc is not on PATH (run scripts/build-k8s)")
        cbin = containerd_bin_dir()
        # runc behind the cpuset mapper: the kubelet's CPU and memory managers hand out
        # the emulated machine's CPU and memory node ids (sandbox.runtimes.cpumap)
        wrapper = cpumap.install(lay.state / "bin" / "runc-cpumap", runc,
                                 str(lay.plugins_netns))
        (self.layout.containerd / "config.toml").write_text(
            containerd_config(self.layout, cbin / "containerd-shim-runc-v2", str(wrapper)))
        (self.layout.cni / "net.d" / "10-hw-sandbox.conflist").write_text(
            json.dumps(cni_config(self.layout), indent=2) + "\n")
        spawn(self.layout, "containerd", [
            *with_node_dev(lay), str(cbin / "containerd"),
            f"--config={lay.containerd / 'config.toml'}",
        ])
        wait_for(self.layout, "containerd", "serving",
                 lambda: run([*ctr(self.layout), "version"], check=False,
                             timeout=None).returncode == 0, 60)

    def _share_kubelet_root(self) -> None:
        """Make the kubelet root a shared mount (a bind of itself), so the volumes the
        kubelet mounts for pods later (the service account token's projected tmpfs,
        secrets, configmaps) propagate into containerd's own mount namespace, a slave
        copy (``with_node_dev``). On hosts whose / is private (this VM's) nothing would
        propagate and a pod would find its token dir empty (seen: ``open
        /var/run/secrets/kubernetes.io/serviceaccount/token: no such file or directory``).
        ``down`` unmounts it with everything else below the kubelet root."""
        root = str(self.root)
        if not os.path.ismount(root):
            run(["mount", "--bind", root, root])
        run(["mount", "--make-rshared", root])

    def images(self) -> None:
        """The local pause and busybox images, imported."""
        ctr_argv = ctr(self.layout)
        self.progress("images (pause, busybox)")
        images = cache_dir() / "images"
        for tarball in (pause_image(images, PAUSE_REF),
                        busybox_image(images, BUSYBOX_REF)):
            # `ctr import` unpacks into the default snapshotter (overlayfs), the CRI's.
            run([*ctr_argv, "images", "import", str(tarball)])
        listed = run([*ctr_argv, "images", "ls", "-q"]).stdout
        for ref in (PAUSE_REF, BUSYBOX_REF):
            if ref not in listed.split():
                raise RuntimeBackendError("images", f"{ref} missing after import: {listed}")

    def kubelet(self) -> None:
        """The kubelet, until healthy."""
        self.progress(f"kubelet (node {self.node.name}, root dir {self.root})")
        cfg = kubelet_config(self.layout, self.node, self.ports, self.feature_gates,
                             self.emulate_topology)
        (self.layout.kubelet / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        # the label the kind runtime gives each node too: bundled manifests select on it
        labels = ",".join(f"{k}={v}" for k, v in [("hwsandbox.dev/node", self.node.name),
                                                  *self.node.labels])
        # a new policy or CPU set would make the kubelet refuse its old state files, and
        # another cluster's device checkpoint would advertise its resources here (with no
        # plugin, until the kubelet's grace period ends)
        for path in (*(self.root / name for name in kubeletns.MANAGER_STATE),
                     DEVICE_PLUGINS_DIR / DEVICE_CHECKPOINT):
            path.unlink(missing_ok=True)
        spawn(self.layout, "kubelet", [
            *(kubeletns.argv_prefix(self.layout.state / "node-root")
              if self.emulate_topology else []),
            str(self.bin / "kubelet"), f"--config={self.layout.kubelet / 'config.yaml'}",
            f"--kubeconfig={self.layout.state / 'kubelet.kubeconfig'}",
            f"--hostname-override={self.node.name}", f"--node-ip={self.host_ip}",
            f"--root-dir={self.root}", f"--cert-dir={self.layout.kubelet / 'pki'}",
            *([f"--node-labels={labels}"] if labels else []), "--v=2",
        ])
        wait_for(self.layout, "kubelet", "healthy", lambda: http_ok(
            f"http://127.0.0.1:{self.ports['kubelet-healthz']}/healthz"), 120)

    def device_plugin(self) -> None:
        start_node_plugins(self.layout, self.progress, self.plugin_options)

    def dra_driver(self) -> None:
        start_dra_driver(self.layout, self.node, self.progress, self.dra_options)

    def ready(self) -> None:
        """Until the node object says Ready."""
        self.progress("waiting for the node to be Ready")
        wait_for(self.layout, "kubelet", f"Ready (node {self.node.name})",
                 lambda: node_ready(self.layout, self.node.name), 180)
        # so that `kubectl apply` of a pod right after `up` works
        wait_for(self.layout, "kube-controller-manager", "the default service account",
                 lambda: default_service_account(self.layout), 60)
        self.progress(f"node {self.node.name} Ready in {time.monotonic() - self.t0:.0f}s; "
                      f"KUBECONFIG={self.layout.kubeconfig}")


def up_steps(up: Up, reference_plugin: bool, dra_driver: bool) -> list[Step]:
    undo = {s.name: s.undo for s in down_steps(up.layout, up.progress)}
    steps = [
        Step("certificates", up.certificates),
        Step("etcd", up.etcd, undo["etcd"]),
        Step("kube-apiserver", up.apiserver, undo["kube-apiserver"]),
        Step("controllers", up.controllers, undo["controllers"]),
        Step("node tree", up.node_tree, undo["node tree"]),
        Step("plugin netns", up.plugin_netns, undo["plugin netns"]),
        Step("containerd", up.containerd, undo["containerd"]),
        Step("images", up.images),
        Step("kubelet", up.kubelet, undo["kubelet"]),
    ]
    if reference_plugin:
        steps.append(Step("device plugin", up.device_plugin, undo["device plugin"]))
    if dra_driver:
        steps.append(Step("DRA driver", up.dra_driver, undo["DRA driver"]))
    steps.append(Step("node Ready", up.ready))
    return steps


def down_steps(layout: Layout, progress: Progress) -> list[Step]:
    """The undo of every step ``up`` may have run, in ``up``'s order."""

    def stopping(*names: str) -> Step:
        def undo() -> None:
            for name in names:
                progress(f"stopping {name}")
                stop(layout, name)
        return Step(names[0], undo=undo)

    def undo_node_tree() -> None:
        from sandbox.agent import unmount

        progress("stopping mount")
        stop(layout, "mount")  # the FUSE server removes the device nodes it made
        node_root = layout.state / "node-root"
        if node_root.is_dir() and node_root.is_mount():
            unmount(node_root)

    def undo_plugin_netns() -> None:
        progress("stopping netlinks")
        stop(layout, "netlinks")  # its links go with it
        if os.path.ismount(layout.plugins_netns):
            run(["umount", str(layout.plugins_netns)], check=False)

    def undo_containerd() -> None:
        netns = remove_containers(layout, progress)
        record = read_record(layout.state)
        if record is not None and netns:  # the host clean-up unmounts them after
            write_record(layout.state, replace(
                record, netns=tuple(sorted(set(record.netns or ()) | set(netns)))))
        progress("stopping containerd")
        stop(layout, "containerd")
        shims = [p for p in (as_proc(pid, "containerd-shim", layout)
                             for pid in shim_pids(layout.containerd_sock)) if p is not None]
        supervisor.stop(shims, timeout=5)

    return [
        Step("certificates"),
        stopping("etcd"),
        stopping("kube-apiserver"),
        Step("controllers", undo=stopping("kube-scheduler", "kube-controller-manager").undo),
        Step("node tree", undo=undo_node_tree),
        Step("plugin netns", undo=undo_plugin_netns),
        Step("containerd", undo=undo_containerd),
        Step("images"),
        stopping("kubelet"),
        Step("device plugin", undo=stopping("deviceplugin").undo),
        Step("DRA driver", undo=stopping("dra-driver").undo),
        Step("node Ready"),
    ]
