"""Constants, paths and process helpers shared by the native runtime's modules."""

from __future__ import annotations

import json
import os
import random
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandbox import supervisor
from sandbox.cache import CONTAINERD_VERSION, cache_root
from sandbox.errors import RuntimeBackendError, SandboxError
from sandbox.supervisor import Proc

K8S_VERSION = os.environ.get("HWSANDBOX_K8S_VERSION", "1.37.2")

PAUSE_REF = "localhost/hw-sandbox/pause:1"
BUSYBOX_REF = "localhost/hw-sandbox/busybox:1"
BRIDGE = "hwsb0"
POD_SUBNET = "10.244.0.0/24"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"
CNI_BIN_DIR = Path("/usr/lib/cni")
DEFAULT_KUBELET_ROOT = Path("/var/lib/kubelet")
# Where the kubelet serves device plugins whatever its --root-dir: the device manager's
# socket is pluginapi.KubeletSocket, a constant (HWSANDBOX_KUBELET_ROOT moves the rest).
DEVICE_PLUGINS_DIR = Path("/var/lib/kubelet/device-plugins")
DEVICE_CHECKPOINT = "kubelet_internal_checkpoint"  # the device manager's, in that dir
HOST_TOOLS = ("runc", "openssl", "ip", "unshare")
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
CONTAINERD_BUILD_HINT = "run scripts/build-containerd"


def cache_dir() -> Path:
    """The project's cache (``sandbox.cache.cache_root``: the scripts' rule too)."""
    return cache_root()


def bin_dir() -> Path:
    """Where ``scripts/build-k8s`` put the Kubernetes binaries and etcd."""
    override = os.environ.get("HWSANDBOX_K8S_BIN")
    return Path(override) if override else cache_dir() / "k8s" / f"v{K8S_VERSION}" / "bin"


def containerd_bin_dir() -> Path:
    """Where ``scripts/build-containerd`` put containerd, its runc shim and ctr."""
    override = os.environ.get("HWSANDBOX_CONTAINERD_BIN")
    if override:
        return Path(override)
    return cache_dir() / "containerd" / f"v{CONTAINERD_VERSION}" / "bin"


def ctr(layout: Layout) -> list[str]:
    """``ctr`` against this sandbox's containerd, namespace k8s.io (the CRI's). The built
    one matching the server; Debian's on PATH only when the build is gone (a ``down``
    after the cache was cleared)."""
    built = containerd_bin_dir() / "ctr"
    exe = str(built) if built.is_file() else "ctr"
    return [exe, f"--address={layout.containerd_sock}", "--namespace=k8s.io"]


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
    def nri(self) -> Path:
        """containerd's NRI socket dir (``nri.sock``): a DRA driver's NRI plugin meets the
        sandbox's containerd here, never a host-wide /var/run/nri."""
        return self.state / "nri"

    @property
    def kubelet(self) -> Path:
        return self.state / "kubelet"

    @property
    def dev(self) -> Path:
        """Host device nodes the node's device plugins hand out (``HostPath``)."""
        return self.state / "dev"

    @property
    def plugins_netns(self) -> Path:
        """The node's plugin network namespace (an nsfs bind at this file): the tree's
        netdevs are real links there, and annotated hostNetwork pods run in it."""
        return self.state / "plugins-netns"

    @property
    def cdi(self) -> Path:
        """CDI specs of prepared DRA claims (the reference DRA driver's ``--cdi-dir``)."""
        return self.state / "cdi"

    @property
    def cdi_plugins(self) -> Path:
        """CDI specs for the CDI names device plugins answer in Allocate: the reference
        plugin's, written at ``up``, and a third-party plugin's /var/run/cdi bound here."""
        return self.state / "cdi-plugins"

    @property
    def kubeconfig(self) -> Path:
        return self.state / "kubeconfig"

    @property
    def dra(self) -> Path:
        """The reference DRA driver's config and checkpoint (``dra_driver=True``)."""
        return self.state / "dra"


# -- processes ---------------------------------------------------------------------------


def running(layout: Layout, name: str) -> Proc | None:
    """The process recorded for ``name`` if that very process (not a reused pid) still runs."""
    proc = Proc.load(layout.run / f"{name}.pid")
    return proc if proc is not None and proc.running() else None


def spawn(layout: Layout, name: str, argv: Sequence[str]) -> Proc:
    """Start ``argv`` detached (``sandbox.supervisor``), output to ``logs/name.log``;
    record it in ``run/name.pid`` (and its argv, for a kubelet restart)."""
    layout.run.mkdir(parents=True, exist_ok=True)
    try:
        proc = supervisor.spawn(name, argv, layout.logs / f"{name}.log")
    except SandboxError as exc:
        raise RuntimeBackendError(f"start {name}", str(exc)) from exc
    proc.save(layout.run / f"{name}.pid")
    (layout.run / f"{name}.argv.json").write_text(json.dumps(list(argv)) + "\n")
    return proc


def stop(layout: Layout, name: str, timeout: float = 15.0) -> None:
    proc = Proc.load(layout.run / f"{name}.pid")
    if proc is not None:
        supervisor.stop([proc], timeout)
    (layout.run / f"{name}.pid").unlink(missing_ok=True)


def wait_for(
    layout: Layout, name: str, what: str, check: Callable[[], bool], timeout: float
) -> None:
    """Poll ``check`` until true; fail early (with the log's tail) if ``name`` died."""
    proc = Proc.load(layout.run / f"{name}.pid")
    if proc is None:
        raise RuntimeBackendError(f"start {name}", f"not running (no record in {layout.run})")
    try:
        supervisor.wait_until(proc, what, check, timeout)
    except SandboxError as exc:
        raise RuntimeBackendError(f"start {name}", str(exc)) from exc


def free_ports(names: Sequence[str]) -> dict[str, int]:
    """One distinct, currently free TCP port per name, for servers that listen on all
    addresses.

    Chosen below the kernel's ephemeral range (``ip_local_port_range``), never from it:
    a port the kernel hands out for a bind to port 0 is also one it hands out to the
    next outgoing connection, and etcd, the API server and their clients make hundreds
    of those before the kubelet starts, so an ephemeral port picked early may be taken
    when the kubelet binds it (seen in CI: ``listen tcp 0.0.0.0:57763: bind: address
    already in use``). Each port is checked with a bind on 0.0.0.0 and held until all are
    chosen, so they differ.
    """
    low, high = _ephemeral_range()
    span = range(max(1024, low - 8000), low) if low - 1024 >= 2 * len(names) else \
        range(high + 1, 65536)
    held: list[socket.socket] = []
    ports: dict[str, int] = {}
    try:
        for port in random.sample(span, len(span)):
            if len(ports) == len(names):
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                s.close()
                continue
            held.append(s)
            ports[names[len(ports)]] = port
    finally:
        for s in held:
            s.close()
    if len(ports) < len(names):
        raise RuntimeBackendError("ports", f"no {len(names)} free TCP ports in "
                                  f"{span.start}-{span.stop - 1}")
    return ports


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return low, high


def host_ip() -> str:
    """The address of the interface with the default route (what the kubelet would pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            addr: str = s.getsockname()[0]
        except OSError:
            addr = "127.0.0.1"
    return addr


def http_ok(url: str, context: ssl.SSLContext | None = None, expect: str = "ok") -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3, context=context) as resp:  # noqa: S310
            body: bytes = resp.read()
    except (urllib.error.URLError, OSError):
        return False
    return expect in body.decode(errors="replace")
