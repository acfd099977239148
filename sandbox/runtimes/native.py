"""The ``native`` runtime: a real single-node Kubernetes run as host processes.

No registry serves kind node images here, so this backend runs components built from
source by ``scripts/build-k8s`` (kept in ``${HWSANDBOX_CACHE:-~/.cache/hw-sandbox}/k8s/
v<version>/bin``) plus Debian's containerd, runc and CNI plugins. ``up`` starts, as
detached processes with pid files and logs under ``state_dir``::

    etcd -> kube-apiserver -> kube-controller-manager, kube-scheduler
         -> node tree (FUSE mount + device nodes) -> containerd -> kubelet
         -> reference device plugin [-> reference DRA driver, ``dra_driver=True``]

It owns: certificates (``openssl`` CLI), kubeconfigs (``state_dir/kubeconfig`` is the
admin's), the containerd and kubelet configs, the CNI config (bridge ``hwsb0`` +
host-local; containerd adds loopback), the local pause and busybox images (``_images``).
The fake hardware comes from ``sandbox.agent`` (``prepare_node_tree``): the kubelet's own
/sys stays real; device plugins read the FUSE tree; containerd sees the node's device
nodes (``state_dir/dev``, all 1:3, plus the fake /dev's relative symlinks such as
``dri/by-path``) under its /dev through an overlay in its own mount namespace
(``_with_node_dev``), so the host's /dev is never written.

Only the profile's FIRST node is run; the Kubernetes node name is its ``NodeSpec.name``.
The kubelet's root dir is ``/var/lib/kubelet`` (``HWSANDBOX_KUBELET_ROOT`` overrides) so
device plugins find ``device-plugins/kubelet.sock`` where they expect it; only one native
sandbox can run on a machine at a time.

``down`` removes everything ``up`` made: pods' containers and network namespaces, every
process (including containerd shims), every mount below the kubelet root and the state
dir, kubelet cgroups, sysctls the kubelet changed, the bridge and the state dir itself.
Docs: ``docs/native-runtime.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sandbox.errors import CommandError, RuntimeBackendError, SandboxError
from sandbox.profile.spec import Cluster, NodeSpec
from sandbox.runtimes import _images
from sandbox.runtimes._procs import proc_start_time, stop_pids
from sandbox.runtimes.base import (
    NodeStatus,
    Progress,
    ResourceStatus,
    SandboxStatus,
    read_record,
    remove_state_dir,
    write_record,
)

K8S_VERSION = os.environ.get("HWSANDBOX_K8S_VERSION", "1.37.2")

PAUSE_REF = "localhost/hw-sandbox/pause:1"
BUSYBOX_REF = "localhost/hw-sandbox/busybox:1"
BRIDGE = "hwsb0"
POD_SUBNET = "10.244.0.0/24"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"
CNI_BIN_DIR = Path("/usr/lib/cni")
DEFAULT_KUBELET_ROOT = Path("/var/lib/kubelet")
HOST_TOOLS = ("containerd", "ctr", "runc", "containerd-shim-runc-v2", "openssl", "ip")
CNI_PLUGINS = ("bridge", "host-local", "loopback")
# Values the kubelet sets itself unless protectKernelDefaults; down() puts them back.
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",  # the bridge plugin turns forwarding on for its gateway
)
# Start order; down() stops in reverse.
ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "containerd",
         "kubelet")
# prepare_node_tree's and the node plugins' processes, stopped first (in this order)
EXTRAS = ("dra-driver", "deviceplugin", "mount")
DRA_DRIVER_ENV = "HWSANDBOX_NATIVE_DRA"  # "1": NativeRuntime() starts the DRA driver too
BUILD_HINT = "run scripts/build-k8s"


def cache_dir() -> Path:
    return Path(os.environ.get("HWSANDBOX_CACHE", str(Path.home() / ".cache" / "hw-sandbox")))


def bin_dir() -> Path:
    """Where ``scripts/build-k8s`` put the Kubernetes binaries and etcd."""
    override = os.environ.get("HWSANDBOX_K8S_BIN")
    return Path(override) if override else cache_dir() / "k8s" / f"v{K8S_VERSION}" / "bin"


def kubelet_root() -> Path:
    return Path(os.environ.get("HWSANDBOX_KUBELET_ROOT", str(DEFAULT_KUBELET_ROOT)))


@dataclass(frozen=True)
class Layout:
    """Every path the native runtime uses under one state dir."""

    state: Path

    @property
    def pki(self) -> Path:
        return self.state / "pki"

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    @property
    def run(self) -> Path:
        return self.state / "run"

    @property
    def containerd(self) -> Path:
        return self.state / "containerd"

    @property
    def containerd_sock(self) -> Path:
        return self.containerd / "containerd.sock"

    @property
    def cni(self) -> Path:
        return self.state / "cni"

    @property
    def kubelet(self) -> Path:
        return self.state / "kubelet"

    @property
    def dev(self) -> Path:
        """Host device nodes the node's device plugins hand out (``HostPath``)."""
        return self.state / "dev"

    @property
    def cdi(self) -> Path:
        return self.state / "cdi"

    @property
    def kubeconfig(self) -> Path:
        return self.state / "kubeconfig"

    @property
    def dra(self) -> Path:
        """The reference DRA driver's config and checkpoint (``dra_driver=True``)."""
        return self.state / "dra"


# -- processes ---------------------------------------------------------------------------


def _read_pid(layout: Layout, name: str) -> int | None:
    """The pid recorded for ``name`` if that very process (not a reused pid) still runs."""
    try:
        pid_s, started = (layout.run / f"{name}.pid").read_text().split()
    except (FileNotFoundError, ValueError):
        return None
    pid = int(pid_s)
    return pid if proc_start_time(pid) == started else None


def _spawn(layout: Layout, name: str, argv: Sequence[str]) -> int:
    """Start ``argv`` detached (own session, stdio to ``logs/name.log``); write its pid file.

    A throwaway ``sh`` forks it and exits, so the process outlives the caller (the CLI
    returns after ``up``) and never becomes a zombie Popen of ours.
    """
    layout.logs.mkdir(parents=True, exist_ok=True)
    layout.run.mkdir(parents=True, exist_ok=True)
    log = layout.logs / f"{name}.log"
    with log.open("a") as fh:
        fh.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n")
    script = 'log=$1; shift; setsid "$@" </dev/null >>"$log" 2>&1 & echo $!'
    proc = subprocess.run(
        ["sh", "-c", script, "sh", str(log), *argv],
        capture_output=True, text=True, check=False, start_new_session=True,
    )
    if proc.returncode != 0 or not proc.stdout.strip().isdigit():
        raise CommandError(argv, proc.returncode, proc.stdout + proc.stderr)
    pid = int(proc.stdout.strip())
    started = proc_start_time(pid)
    if started is None:
        raise RuntimeBackendError(f"start {name}", f"exited at once:\n{_log_tail(layout, name)}")
    (layout.run / f"{name}.pid").write_text(f"{pid} {started}\n")
    (layout.run / f"{name}.argv.json").write_text(json.dumps(list(argv)) + "\n")
    return pid


def _kill(pid: int, timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; returns once the process is gone (or 5 s
    after SIGKILL)."""
    stop_pids([pid], timeout, kill_timeout=5.0, poll=0.1)


def _stop(layout: Layout, name: str, timeout: float = 15.0) -> None:
    pid = _read_pid(layout, name)
    if pid is not None:
        _kill(pid, timeout)
    (layout.run / f"{name}.pid").unlink(missing_ok=True)


def _log_tail(layout: Layout, name: str, lines: int = 15) -> str:
    try:
        text = (layout.logs / f"{name}.log").read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join("  " + line for line in text.splitlines()[-lines:])


def _wait_for(
    layout: Layout, name: str, what: str, check: Callable[[], bool], timeout: float
) -> None:
    """Poll ``check`` until true; fail early (with the log's tail) if ``name`` died."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            if check():
                return
        if _read_pid(layout, name) is None:
            raise RuntimeBackendError(
                f"start {name}",
                f"exited before {what}; log {layout.logs / (name + '.log')}:\n"
                + _log_tail(layout, name),
            )
        if time.monotonic() > deadline:
            raise RuntimeBackendError(
                f"start {name}",
                f"not {what} after {timeout:.0f}s; log {layout.logs / (name + '.log')}:\n"
                + _log_tail(layout, name),
            )
        time.sleep(0.3)


def _run(argv: Sequence[str], check: bool = True, timeout: float = 120) -> str:
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, check=False, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise CommandError(argv, proc.returncode, proc.stdout + proc.stderr)
    return proc.stdout


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _host_ip() -> str:
    """The address of the interface with the default route (what the kubelet would pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            addr: str = s.getsockname()[0]
        except OSError:
            addr = "127.0.0.1"
    return addr


def _http_ok(url: str, context: ssl.SSLContext | None = None, expect: str = "ok") -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3, context=context) as resp:  # noqa: S310
            body: bytes = resp.read()
    except (urllib.error.URLError, OSError):
        return False
    return expect in body.decode(errors="replace")


# -- certificates and kubeconfigs ----------------------------------------------------------


def _openssl(*args: str) -> None:
    _run(["openssl", *args])


def _new_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", str(path))
    path.chmod(0o600)


def _issue(pki: Path, name: str, subject: str, usage: str, sans: Sequence[str] = ()) -> None:
    """``name.key`` + ``name.crt`` signed by the sandbox CA."""
    key, csr, crt, ext = (pki / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
    _new_key(key)
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
    lines = [
        "[v3]",
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
    ]
    if sans:
        lines.append("subjectAltName=" + ",".join(sans))
    ext.write_text("\n".join(lines) + "\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey",
             str(pki / "ca.key"), "-set_serial", "0x" + secrets.token_hex(16), "-days", "365",
             "-extfile", str(ext), "-extensions", "v3", "-out", str(crt))
    csr.unlink()
    ext.unlink()


def _make_pki(pki: Path, node: str, host_ip: str) -> None:
    pki.mkdir(parents=True, exist_ok=True, mode=0o700)
    _new_key(pki / "ca.key")
    _openssl("req", "-x509", "-new", "-key", str(pki / "ca.key"), "-subj", "/CN=hw-sandbox-ca",
             "-days", "3650", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
             "-out", str(pki / "ca.crt"))
    sans = ["DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local", "DNS:localhost", "IP:127.0.0.1",
            f"IP:{SERVICE_IP}", f"IP:{host_ip}"]
    _issue(pki, "apiserver", "/CN=kube-apiserver", "serverAuth", sans)
    _issue(pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client",
           "clientAuth")
    _issue(pki, "admin", "/O=system:masters/CN=kubernetes-admin", "clientAuth")
    _issue(pki, "controller-manager", "/CN=system:kube-controller-manager", "clientAuth")
    _issue(pki, "scheduler", "/CN=system:kube-scheduler", "clientAuth")
    _issue(pki, "kubelet", f"/O=system:nodes/CN=system:node:{node}", "clientAuth")
    _new_key(pki / "sa.key")
    _openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def _write_kubeconfig(path: Path, server: str, pki: Path, user: str, cluster: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster, "cluster": {
            "server": server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": user, "user": {
            "client-certificate": str(pki / f"{user}.crt"),
            "client-key": str(pki / f"{user}.key")}}],
        "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": user}}],
        "current-context": cluster,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)


# -- configs ---------------------------------------------------------------------------


def containerd_config(layout: Layout) -> str:
    c = layout.containerd
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{c / 'root'}"
state = "{c / 'state'}"

[grpc]
  address = "{layout.containerd_sock}"

[ttrpc]
  address = "{layout.containerd_sock}.ttrpc"

[debug]
  level = "info"

[plugins."io.containerd.internal.v1.opt"]
  path = "{c / 'opt'}"

[{cri}]
  sandbox_image = "{PAUSE_REF}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  netns_mounts_under_state_dir = true
  # No CAP_SYS_RESOURCE in this VM: runc cannot lower oom_score_adj (sandboxes ask -998)
  # below containerd's own; clamp instead of failing every pod.
  restrict_oom_score_adj = true
  # containerd 1.6 ignores these two (CDI arrived in 1.7); kept for a newer containerd
  enable_cdi = true
  cdi_spec_dirs = ["{layout.cdi}"]

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{c / 'runc'}"

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{layout.cni / 'net.d'}"
  max_conf_num = 1
"""


def cni_config(layout: Layout) -> dict[str, Any]:
    return {
        "cniVersion": "0.4.0",
        "name": "hw-sandbox",
        "plugins": [{
            "type": "bridge",
            "bridge": BRIDGE,
            "isGateway": True,
            "ipMasq": False,  # no iptables rules on the host; there is no uplink to reach
            "hairpinMode": True,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": POD_SUBNET}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": str(layout.cni / "ipam"),
            },
        }],
    }


def kubelet_config(layout: Layout, node: NodeSpec, ports: dict[str, int],
                   feature_gates: dict[str, bool]) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # the build machines run cgroup v1
        "cgroupDriver": "cgroupfs",  # PID 1 is not systemd
        "containerRuntimeEndpoint": f"unix://{layout.containerd_sock}",
        "address": "0.0.0.0",
        "port": ports["kubelet"],
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": ports["kubelet-healthz"],
        "readOnlyPort": 0,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(layout.pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "topologyManagerPolicy": node.topology_manager_policy,
        "featureGates": feature_gates,
        "failSwapOn": False,
        "makeIPTablesUtilChains": False,  # leave the host's iptables alone
        "podLogsDir": str(layout.state / "pod-logs"),
        "volumePluginDir": str(layout.kubelet / "volume-plugins"),
        "resolvConf": "/etc/resolv.conf",
        "clusterDomain": "cluster.local",
        "serializeImagePulls": False,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
    }


# -- the fake hardware hook ----------------------------------------------------------------


# Run in containerd's own mount namespace (slave: the kubelet's volume mounts still reach
# it): /dev becomes a read-only overlay of the host's /dev over the node's device dir, so
# the CRI finds /dev/nvidia0 & co. when it stats an Allocate response's host paths, while
# the host's /dev is never written. Submounts (pts, shm, ...) are moved back on top.
_NODE_DEV_SCRIPT = """set -e
stage=$1; nodedev=$2; shift 2
mkdir -p "$stage"
for m in pts shm mqueue hugepages; do
    if mountpoint -q "/dev/$m"; then mkdir -p "$stage/$m"; mount --bind "/dev/$m" "$stage/$m"; fi
done
mount -t overlay hwsb-dev -o "lowerdir=/dev:$nodedev" /dev
for m in pts shm mqueue hugepages; do
    if [ -d "$stage/$m" ] && mountpoint -q "$stage/$m"; then mount --move "$stage/$m" "/dev/$m"; fi
done
exec "$@"
"""


def _with_node_dev(layout: Layout) -> list[str]:
    """argv prefix: run the command with the node's device nodes visible under /dev."""
    return ["unshare", "--mount", "--propagation", "slave", "sh", "-c", _NODE_DEV_SCRIPT,
            "sh", str(layout.containerd / "dev-stage"), str(layout.dev)]


def _adopt(layout: Layout, name: str, pid: int) -> None:
    """Record a process started elsewhere (detached) so ``down`` stops it like ours."""
    started = proc_start_time(pid)
    if started is None:
        raise RuntimeBackendError(f"start {name}", f"pid {pid} is not running")
    layout.run.mkdir(parents=True, exist_ok=True)
    (layout.run / f"{name}.pid").write_text(f"{pid} {started}\n")


def prepare_node_tree(layout: Layout, node: NodeSpec, profile_path: str,
                      progress: Progress) -> None:
    """The node's fake hardware: the lead wires the FUSE mount here.

    Runs before containerd starts. Mounts the node's fake root (``sys/``, ``dev/``,
    ``proc/``; ``sandbox mount`` via ``sandbox.agent``) at ``state_dir/node-root`` with its
    control socket in ``state_dir/node``. The server also creates one host device node per
    fake ``/dev`` character device under ``state_dir/dev`` (never in the host's /dev), all
    ``1:3`` (/dev/null), and removes them when it exits; containerd sees them under its
    /dev (``_with_node_dev``). The kubelet's own /sys stays real. Recorded in
    ``state_dir/run`` and stopped first by ``down``.
    """
    from sandbox.agent import spawn_node

    root = layout.state / "node-root"
    progress(f"mounting {node.name}'s fake /sys, /dev, /proc at {root}")
    try:
        pid = spawn_node(profile_path, node.base_name, root, index=node.index,
                         state_dir=layout.state / "node", log_file=layout.logs / "mount.log",
                         dev_dir=layout.dev, extra=["--dev-map", "1:3"])
    except SandboxError as exc:
        raise RuntimeBackendError("mount", str(exc)) from exc
    _adopt(layout, "mount", pid)
    _link_dev_symlinks(layout, node)


def _link_dev_symlinks(layout: Layout, node: NodeSpec) -> None:
    """Copy the fake /dev's relative symlinks (``dri/by-path/pci-…-card -> ../card0``)
    into ``state_dir/dev`` next to the device nodes the mount server made there.

    Plugins hand such links out as mounts (Intel's GPU plugin mounts
    ``/dev/dri/by-path/pci-<bdf>-card``); the CRI stats a mount's host path and, when it
    is missing, tries to mkdir it, which fails on containerd's read-only /dev overlay.
    Made from the node's full tree, like the device nodes, so they never change after up.
    """
    from sandbox.fakehw.build import build_tree
    from sandbox.fakehw.tree import Symlink

    tree = build_tree(node, {})
    dev = layout.dev.resolve()
    for path, entry in tree.walk():
        if not path.startswith("dev/") or not isinstance(entry, Symlink):
            continue
        link = layout.dev / path.removeprefix("dev/")
        target = (link.parent / entry.target).resolve()
        if entry.target.startswith("/") or dev not in target.parents:
            continue  # only links that stay inside the node's /dev
        link.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            link.symlink_to(entry.target)


def start_node_plugins(layout: Layout, progress: Progress) -> None:
    """The reference device plugin on the fake root, against the real kubelet.

    Runs once the kubelet is healthy (the plugin registers with its kubelet.sock).
    """
    progress("reference device plugin")
    _spawn(layout, "deviceplugin", [
        sys.executable, "-m", "hwplugins.deviceplugin", "--root",
        str(layout.state / "node-root"), "--kubelet-dir", str(kubelet_root() / "device-plugins"),
    ])


def start_dra_driver(layout: Layout, node: NodeSpec, progress: Progress) -> None:
    """The reference DRA driver (``python -m hwplugins.dra``) on the fake root, against the
    real kubelet and API server.

    Runs once the kubelet is healthy: it waits for the kubelet's ``plugins_registry`` (the
    kubelet's plugin watcher creates it), then the driver serves
    ``plugins/dra.hwsandbox.dev/dra.sock`` and registers through
    ``plugins_registry/dra.hwsandbox.dev-reg.sock``. CDI specs of prepared claims go to
    ``state_dir/cdi`` (containerd's ``cdi_spec_dirs``; containerd 1.6 ignores it), their
    ``hostPath``s name the node's device nodes in ``state_dir/dev``; the partition config
    (``sandbox dra config``) and the checkpoint live in ``state_dir/dra``, so nothing of a
    torn-down cluster is left under the kubelet root. API access: the admin kubeconfig.
    """
    from hwplugins.dra import DRIVER

    from sandbox.dra import driver_config

    root = kubelet_root()
    registry = root / "plugins_registry"
    _wait_for(layout, "kubelet", f"serving its plugin watcher ({registry})",
              registry.is_dir, 60)
    layout.dra.mkdir(parents=True, exist_ok=True)
    layout.cdi.mkdir(parents=True, exist_ok=True)
    config = layout.dra / "config.json"
    config.write_text(json.dumps(driver_config(node), indent=2) + "\n")
    progress("reference DRA driver")
    _spawn(layout, "dra-driver", [
        sys.executable, "-m", "hwplugins.dra", "--root", str(layout.state / "node-root"),
        "--node-name", node.name, "--kubeconfig", str(layout.kubeconfig),
        "--config", str(config), "--plugins-dir", str(root / "plugins"),
        "--registry-dir", str(registry), "--cdi-dir", str(layout.cdi),
        "--host-dev-dir", str(layout.dev), "--checkpoint", str(layout.dra / "checkpoint.json"),
    ])
    socket_path = registry / f"{DRIVER}-reg.sock"
    _wait_for(layout, "dra-driver", f"serving {socket_path}", socket_path.exists, 60)


# -- cleanup helpers ----------------------------------------------------------------------


def _mounts_below(*roots: Path) -> list[str]:
    """Mount points at or below any of ``roots``, deepest first."""
    prefixes = [str(r.resolve()) for r in roots]
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == p or point.startswith(p + "/") for p in prefixes):
            found.append(point)
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


def _unmount_below(*roots: Path) -> None:
    for _ in range(3):  # stacked mounts need more than one pass
        points = _mounts_below(*roots)
        if not points:
            return
        for point in points:
            _run(["umount", "-l", point], check=False)


def _shim_pids(sock: Path) -> list[int]:
    """containerd shims started by OUR containerd (their argv names its socket)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and b"containerd-shim" in argv[0] and str(sock).encode() in argv:
            pids.append(int(entry.name))
    return pids


def _cgroup_dirs(name: str) -> Iterator[Path]:
    root = Path("/sys/fs/cgroup")
    if not root.is_dir():
        return
    for hierarchy in root.iterdir():
        d = hierarchy / name
        if d.is_dir():
            yield d


def _rmdir_tree(top: Path) -> None:
    for dirpath, _dirnames, _files in sorted(os.walk(top), key=lambda t: -len(t[0])):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)


def _sysctl(key: str) -> str | None:
    try:
        return (Path("/proc/sys") / key).read_text().strip()
    except OSError:
        return None


# -- the runtime --------------------------------------------------------------------------


class NativeRuntime:
    """Real etcd, kube-apiserver, controller-manager, scheduler, containerd and kubelet."""

    name = "native"

    def __init__(self, feature_gates: dict[str, bool] | None = None,
                 reference_plugin: bool = True, dra_driver: bool | None = None) -> None:
        self.feature_gates = dict(feature_gates or {})
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
        tools = [t for t in HOST_TOOLS if shutil.which(t) is None]
        plugins = [p for p in CNI_PLUGINS if not (CNI_BIN_DIR / p).is_file()]
        if tools or plugins:
            what = tools + [f"{CNI_BIN_DIR}/{p}" for p in plugins]
            return f"missing {', '.join(what)} ({BUILD_HINT}; it installs the Debian packages)"
        if shutil.which("fusermount3") is None:
            return "missing fusermount3 for the node's FUSE tree (run scripts/install-system-deps)"
        if not _images.BUSYBOX.is_file() or shutil.which("gcc") is None:
            return f"missing busybox-static or gcc ({BUILD_HINT})"
        if _kubelet_running():
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
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        root = kubelet_root()
        host_ip = _host_ip()
        ports = {k: _free_port() for k in ("etcd", "etcd-peer", "apiserver",
                                           "controller-manager", "scheduler", "kubelet",
                                           "kubelet-healthz")}
        record: dict[str, Any] = {
            "runtime": self.name,
            "profile": profile_path,
            "cluster": cluster.name,
            "name": state_dir.name,
            # same shape as the local runtime's: `sandbox fault` finds the control socket
            "nodes": {node.name: {
                "root": str(state_dir / "node-root"),
                "socket": str(state_dir / "node" / "control.sock"),
                "kubelet_dir": str(root / "device-plugins"),
            }},
            "version": K8S_VERSION,
            "bin_dir": str(bin_dir()),
            "ports": ports,
            "host_ip": host_ip,
            "kubelet_root": str(root),
            # containerd 1.6 puts shim sockets in /run/containerd/s whatever its state dir
            "created": [str(p) for p in (root, Path("/var/log/containers"), Path("/var/lib/cni"),
                                         Path("/run/containerd")) if not p.exists()],
            "sysctls": {k: _sysctl(k) for k in KUBELET_SYSCTLS},
            "netns": [],
            "dra_driver": self.dra_driver,
        }
        write_record(state_dir, record)
        try:
            self._up(layout, node, profile_path, ports, host_ip, root, progress)
        except BaseException:
            progress("up failed; cleaning up (logs are kept in a copy: see below)")
            self._save_logs(layout, progress)
            self.down(state_dir, lambda _m: None)
            raise

    def _save_logs(self, layout: Layout, progress: Progress) -> None:
        if layout.logs.is_dir():
            keep = layout.state.with_name(layout.state.name + ".failed-logs")
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(layout.logs, keep)
            progress(f"logs of the failed start: {keep}")

    def _up(self, layout: Layout, node: NodeSpec, profile_path: str, ports: dict[str, int],
            host_ip: str, root: Path, progress: Progress) -> None:
        b = bin_dir()
        t0 = time.monotonic()
        progress("certificates")
        _make_pki(layout.pki, node.name, host_ip)
        server = f"https://127.0.0.1:{ports['apiserver']}"
        _write_kubeconfig(layout.kubeconfig, server, layout.pki, "admin", "hw-sandbox")
        for user in ("controller-manager", "scheduler", "kubelet"):
            _write_kubeconfig(layout.state / f"{user}.kubeconfig", server, layout.pki, user,
                              "hw-sandbox")

        progress("etcd")
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
        _spawn(layout, "etcd", [
            str(b / "etcd"), "--name=hw-sandbox", f"--data-dir={layout.state / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=hw-sandbox={peer_url}", "--unsafe-no-fsync",
            "--log-level=warn",
        ])
        _wait_for(layout, "etcd", "healthy",
                  lambda: _http_ok(f"{etcd_url}/health", expect='"health":"true"'), 60)

        progress("kube-apiserver")
        pki = layout.pki
        gates = ",".join(f"{k}={str(v).lower()}" for k, v in sorted(self.feature_gates.items()))
        _spawn(layout, "kube-apiserver", [
            str(b / "kube-apiserver"), f"--etcd-servers={etcd_url}",
            "--bind-address=0.0.0.0", f"--advertise-address={host_ip}",
            f"--secure-port={ports['apiserver']}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            # The node name (gpu-worker) does not resolve; reach the kubelet by its IP.
            "--kubelet-preferred-address-types=InternalIP",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true", "--profiling=false",
            f"--cert-dir={layout.state / 'apiserver-certs'}",
            *([f"--feature-gates={gates}"] if gates else []),
        ])
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        _wait_for(layout, "kube-apiserver", "ready",
                  lambda: _http_ok(f"{server}/readyz", ctx), 120)

        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        progress("kube-controller-manager, kube-scheduler")
        kcm_cfg = str(layout.state / "controller-manager.kubeconfig")
        _spawn(layout, "kube-controller-manager", [
            str(b / "kube-controller-manager"), f"--kubeconfig={kcm_cfg}",
            f"--authentication-kubeconfig={kcm_cfg}", f"--authorization-kubeconfig={kcm_cfg}",
            "--bind-address=127.0.0.1", f"--secure-port={ports['controller-manager']}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            "--controllers=*,bootstrapsigner,tokencleaner", "--cluster-name=hw-sandbox",
            # default /usr/libexec/kubernetes/...: it would create it on the host
            f"--flex-volume-plugin-dir={layout.state / 'flex-volume-plugins'}",
            *([f"--feature-gates={gates}"] if gates else []),
        ])
        sched_cfg = str(layout.state / "scheduler.kubeconfig")
        _spawn(layout, "kube-scheduler", [
            str(b / "kube-scheduler"), f"--kubeconfig={sched_cfg}",
            f"--authentication-kubeconfig={sched_cfg}",
            f"--authorization-kubeconfig={sched_cfg}",
            "--bind-address=127.0.0.1", f"--secure-port={ports['scheduler']}",
            "--leader-elect=false",
            *([f"--feature-gates={gates}"] if gates else []),
        ])
        _wait_for(layout, "kube-controller-manager", "healthy", lambda: _http_ok(
            f"https://127.0.0.1:{ports['controller-manager']}/healthz", insecure), 60)
        _wait_for(layout, "kube-scheduler", "healthy", lambda: _http_ok(
            f"https://127.0.0.1:{ports['scheduler']}/healthz", insecure), 60)

        prepare_node_tree(layout, node, profile_path, progress)

        progress("containerd")
        for d in (layout.containerd, layout.cni / "net.d", layout.cdi, layout.kubelet):
            d.mkdir(parents=True, exist_ok=True)
        (layout.containerd / "config.toml").write_text(containerd_config(layout))
        (layout.cni / "net.d" / "10-hw-sandbox.conflist").write_text(
            json.dumps(cni_config(layout), indent=2) + "\n")
        _spawn(layout, "containerd", [
            *_with_node_dev(layout), "containerd", f"--config={layout.containerd / 'config.toml'}",
        ])
        ctr = ["ctr", f"--address={layout.containerd_sock}", "--namespace=k8s.io"]
        _wait_for(layout, "containerd", "serving",
                  lambda: subprocess.run([*ctr, "version"], capture_output=True,
                                         check=False).returncode == 0, 60)

        progress("images (pause, busybox)")
        images = cache_dir() / "images"
        for tarball in (_images.pause_image(images, PAUSE_REF),
                        _images.busybox_image(images, BUSYBOX_REF)):
            # `ctr import` unpacks into the default snapshotter (overlayfs), the CRI's.
            _run([*ctr, "images", "import", str(tarball)])
        listed = _run([*ctr, "images", "ls", "-q"])
        for ref in (PAUSE_REF, BUSYBOX_REF):
            if ref not in listed.split():
                raise RuntimeBackendError("images", f"{ref} missing after import: {listed}")

        progress(f"kubelet (node {node.name}, root dir {root})")
        cfg = kubelet_config(layout, node, ports, self.feature_gates)
        (layout.kubelet / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        # the label the kind runtime gives each node too: bundled manifests select on it
        labels = ",".join(f"{k}={v}" for k, v in [("hwsandbox.dev/node", node.name),
                                                     *node.labels])
        _spawn(layout, "kubelet", [
            str(b / "kubelet"), f"--config={layout.kubelet / 'config.yaml'}",
            f"--kubeconfig={layout.state / 'kubelet.kubeconfig'}",
            f"--hostname-override={node.name}", f"--node-ip={host_ip}",
            f"--root-dir={root}", f"--cert-dir={layout.kubelet / 'pki'}",
            *([f"--node-labels={labels}"] if labels else []), "--v=2",
        ])
        _wait_for(layout, "kubelet", "healthy", lambda: _http_ok(
            f"http://127.0.0.1:{ports['kubelet-healthz']}/healthz"), 120)

        if self.reference_plugin:
            start_node_plugins(layout, progress)
        if self.dra_driver:
            start_dra_driver(layout, node, progress)

        progress("waiting for the node to be Ready")
        _wait_for(layout, "kubelet", f"Ready (node {node.name})",
                  lambda: _node_ready(layout, node.name), 180)
        progress(f"node {node.name} Ready in {time.monotonic() - t0:.0f}s; "
                 f"KUBECONFIG={layout.kubeconfig}")

    # -- down ---------------------------------------------------------------------------
    def down(self, state_dir: Path, progress: Progress) -> None:
        layout = Layout(state_dir)
        record = read_record(state_dir) or {}
        root = Path(record.get("kubelet_root", str(kubelet_root())))
        # The fake hardware goes first: plugins, then the FUSE server (which removes dev/).
        for name in EXTRAS:
            progress(f"stopping {name}")
            _stop(layout, name)
        progress("stopping kubelet")
        _stop(layout, "kubelet")
        netns = self._remove_containers(layout, progress)
        for name in reversed(ORDER[:-1]):
            progress(f"stopping {name}")
            _stop(layout, name)
        for pid in _shim_pids(layout.containerd_sock):
            _kill(pid, 5)
        node_root = layout.state / "node-root"
        if os.path.ismount(node_root):
            from sandbox.agent import unmount

            unmount(node_root)
        progress("unmounting")
        _unmount_below(root, state_dir)
        for ns in netns:
            _run(["umount", ns], check=False)
            with contextlib.suppress(OSError):
                os.unlink(ns)
        _run(["ip", "link", "del", BRIDGE], check=False)
        for name in ("kubepods", "kubepods.slice"):
            for d in _cgroup_dirs(name):
                _rmdir_tree(d)
        for key, value in (record.get("sysctls") or {}).items():
            if value is not None and _sysctl(key) != value:
                with contextlib.suppress(OSError):
                    (Path("/proc/sys") / key).write_text(value + "\n")
        cni_cache = Path("/var/lib/cni/results")
        if cni_cache.is_dir():
            for f in cni_cache.glob("hw-sandbox-*"):
                f.unlink(missing_ok=True)
        logs = Path("/var/log/containers")
        if logs.is_dir():
            for link in logs.iterdir():
                if link.is_symlink() and os.readlink(link).startswith(str(state_dir)):
                    link.unlink()
        for created in record.get("created", []):
            path = Path(created)
            if path.exists() and not _mounts_below(path):
                shutil.rmtree(path, ignore_errors=True)
        if state_dir.exists() and _mounts_below(state_dir):
            raise RuntimeBackendError("down", f"mounts remain below {state_dir}")
        try:
            remove_state_dir(state_dir)
        except (SandboxError, OSError) as exc:
            raise RuntimeBackendError("down", str(exc)) from exc

    def _remove_containers(self, layout: Layout, progress: Progress) -> list[str]:
        """Kill and delete every k8s.io task and container; return their netns paths."""
        if _read_pid(layout, "containerd") is None:
            return []
        ctr = ["ctr", f"--address={layout.containerd_sock}", "--namespace=k8s.io"]
        netns: set[str] = set()
        ids = _run([*ctr, "containers", "ls", "-q"], check=False).split()
        if ids:
            progress(f"removing {len(ids)} containers")
        for cid in ids:
            with contextlib.suppress(json.JSONDecodeError, CommandError):
                info = json.loads(_run([*ctr, "containers", "info", cid]))
                for ns in info.get("Spec", {}).get("linux", {}).get("namespaces", []):
                    path = ns.get("path", "")
                    if ns.get("type") == "network" and "/netns/" in path:
                        netns.add(path)
            _run([*ctr, "tasks", "kill", "-s", "SIGKILL", cid], check=False)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            tasks = _run([*ctr, "tasks", "ls", "-q"], check=False).split()
            for cid in tasks:
                _run([*ctr, "tasks", "delete", "--force", cid], check=False, timeout=30)
            if not tasks:
                break
            time.sleep(0.3)
        for cid in ids:
            _run([*ctr, "containers", "rm", cid], check=False)
        return sorted(netns)

    # -- kubelet restart ----------------------------------------------------------------
    def restart_kubelet(self, state_dir: Path, node: str) -> None:
        layout = Layout(state_dir)
        record = read_record(state_dir) or {}
        if node not in record.get("nodes", []):
            raise RuntimeBackendError("restart kubelet", f"no node {node!r} in {state_dir}")
        argv = json.loads((layout.run / "kubelet.argv.json").read_text())
        _stop(layout, "kubelet")
        _spawn(layout, "kubelet", argv)
        healthz = f"http://127.0.0.1:{record['ports']['kubelet-healthz']}/healthz"
        _wait_for(layout, "kubelet", "healthy", lambda: _http_ok(healthz), 120)

    # -- status -------------------------------------------------------------------------
    def status(self, state_dir: Path) -> SandboxStatus:
        layout = Layout(state_dir)
        record = read_record(state_dir)
        if record is None:
            raise RuntimeBackendError("status", f"no sandbox in {state_dir}")
        result = SandboxStatus(name=str(record.get("cluster", state_dir.name)),
                               runtime=self.name, profile=str(record.get("profile", "")))
        for name in record.get("nodes", []):
            result.nodes.append(_node_status(layout, name))
        return result


def _kubelet_running() -> bool:
    """Is a kubelet of some native sandbox already using the kubelet root?"""
    sock = kubelet_root() / "device-plugins" / "kubelet.sock"
    if not sock.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(sock))
        except OSError:
            return False
    return True


def _api(layout: Layout) -> Any:
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=str(layout.kubeconfig))
    return client.CoreV1Api(api_client)


def _node_ready(layout: Layout, name: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    api = _api(layout)
    try:
        node = api.read_node(name)
    except ApiException:
        return False
    finally:
        api.api_client.close()
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


def _node_status(layout: Layout, name: str) -> NodeStatus:
    from kubernetes.client.exceptions import ApiException

    status = NodeStatus(name=name, ready=False)
    for proc in ORDER:
        if _read_pid(layout, proc) is None:
            status.notes.append(f"{proc} is not running (log {layout.logs / (proc + '.log')})")
    if (layout.run / "dra-driver.pid").exists() and _read_pid(layout, "dra-driver") is None:
        status.notes.append(f"the DRA driver is not running (log {layout.logs / 'dra-driver.log'})")
    api = _api(layout)
    try:
        node = api.read_node(name)
    except (ApiException, OSError) as exc:
        status.notes.append(f"cannot read node {name}: {exc}")
        return status
    finally:
        api.api_client.close()
    conditions = node.status.conditions or []
    status.ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
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
