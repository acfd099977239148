"""containerd, CNI and kubelet configuration for the native runtime's node, and the
command lines of its control plane (etcd, kube-apiserver, kube-scheduler) that the DRA
tests' control plane starts too."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sandbox.profile.spec import NodeSpec
from sandbox.runtimes.kubeletcfg import topology_config
from sandbox.runtimes.native.common import (
    BRIDGE,
    CNI_BIN_DIR,
    PAUSE_REF,
    POD_SUBNET,
    SERVICE_CIDR,
    Layout,
)

# The issuer of service account tokens, and so (no --api-audiences) the one audience the
# API server accepts in a token.
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"


def gate_flags(gates: Mapping[str, bool]) -> list[str]:
    """``--feature-gates=A=true,B=false`` (sorted), or nothing for no gates."""
    flag = ",".join(f"{k}={str(v).lower()}" for k, v in sorted(gates.items()))
    return [f"--feature-gates={flag}"] if flag else []


def etcd_argv(bin_dir: Path, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    """A one-member etcd on loopback, plain HTTP, no fsync (a throwaway cluster's)."""
    client_url = f"http://127.0.0.1:{client_port}"
    peer_url = f"http://127.0.0.1:{peer_port}"
    return [
        str(bin_dir / "etcd"), "--name=hw-sandbox", f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}", f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=hw-sandbox={peer_url}", "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def apiserver_argv(bin_dir: Path, pki: Path, etcd_port: int, port: int, cert_dir: Path,
                   gates: Mapping[str, bool]) -> list[str]:
    """kube-apiserver with the certificates of ``pki.make_pki``: it serves ``apiserver.crt``,
    takes the CA's client certificates (``admin.crt``: system:masters) and service account
    tokens signed with ``sa.key`` (issuer ``SERVICE_ACCOUNT_ISSUER``). The caller adds
    where it binds, its authorizers and admission plugins."""
    return [
        str(bin_dir / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        f"--secure-port={port}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--allow-privileged=true", "--profiling=false", f"--cert-dir={cert_dir}",
        *gate_flags(gates),
    ]


def scheduler_argv(bin_dir: Path, kubeconfig: Path, port: int,
                   gates: Mapping[str, bool]) -> list[str]:
    """kube-scheduler with ``kubeconfig`` for everything, its health on loopback ``port``."""
    kc = str(kubeconfig)
    return [
        str(bin_dir / "kube-scheduler"), f"--kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
        "--bind-address=127.0.0.1", f"--secure-port={port}", "--leader-elect=false",
        *gate_flags(gates),
    ]


def containerd_config(layout: Layout, shim: Path, runc: str) -> str:
    """containerd 2.x, config version 4 (2.4's own; a version 3 file works too, migrated at
    every start with a warning). ``shim`` is the built ``containerd-shim-runc-v2``
    (named outright: containerd looks up ``$PATH`` first, where Debian's 1.6 shim may be),
    ``runc`` the runc binary it drives.

    CDI is always on in containerd 2.x (the 1.7 ``enable_cdi`` switch is gone from 2.4's
    config); ``cdi_spec_dirs``: where the DRA driver writes its specs, and the device
    plugins' specs (a CDI name a device plugin answers must resolve, or containerd 2 fails
    the container: ``CDI device injection failed: unresolvable CDI devices``). cgroup v1 needs no
    setting (2.x logs a deprecation warning, ``io.containerd.deprecation/cgroup-v1``).
    """
    c = layout.containerd
    runtime = "plugins.'io.containerd.cri.v1.runtime'"
    return f"""version = 4
root = "{c / 'root'}"
state = "{c / 'state'}"
imports = []  # not the default /etc/containerd/conf.d/*.toml: nothing of the host's

[debug]
  level = "info"

[plugins.'io.containerd.server.v1.grpc']
  address = "{layout.containerd_sock}"

[plugins.'io.containerd.server.v1.ttrpc']
  address = "{layout.containerd_sock}.ttrpc"

[plugins.'io.containerd.internal.v1.opt']
  path = "{c / 'opt'}"

# NRI (for DRA drivers with an NRI plugin, e.g. dra-driver-cpu): on, but at a socket and
# plugin dirs of this sandbox's, never the host-wide /var/run/nri/nri.sock and /opt/nri
# where a plugin of the host's (or a host containerd's) would meet ours.
[plugins.'io.containerd.nri.v1.nri']
  disable = false
  socket_path = "{layout.nri / 'nri.sock'}"
  plugin_path = "{layout.nri / 'plugins'}"
  plugin_config_path = "{layout.nri / 'conf.d'}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{PAUSE_REF}"

[{runtime}]
  netns_mounts_under_state_dir = true
  # No CAP_SYS_RESOURCE in this VM: runc cannot lower oom_score_adj (sandboxes ask -998)
  # below containerd's own; clamp instead of failing every pod.
  restrict_oom_score_adj = true
  cdi_spec_dirs = ["{layout.cdi}", "{layout.cdi_plugins}"]

[{runtime}.containerd]
  default_runtime_name = "runc"

[{runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  runtime_path = "{shim}"
  # into the OCI configs, where the runtime (oci-cpumap) puts annotated hostNetwork pods
  # into the node's plugin network namespace (native.node.start_plugin_netns)
  pod_annotations = ["hwsandbox.dev/netns"]

[{runtime}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  BinaryName = "{runc}"
  Root = "{c / 'runc'}"

[{runtime}.cni]
  bin_dirs = ["{CNI_BIN_DIR}"]
  conf_dir = "{layout.cni / 'net.d'}"
  max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
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


# evictionHard memory.available; the memory manager's reservations must cover it
EVICTION_MEMORY_MIB = 100


def kubelet_config(layout: Layout, node: NodeSpec, ports: dict[str, int],
                   feature_gates: dict[str, bool], emulate_topology: bool = True) -> dict[str, Any]:
    """The kubelet's config; ``emulate_topology`` False (``sandbox up --kubelet-topology
    host``): the kubelet sees the host's machine, and of the profile's manager settings only
    the topology manager policy applies (the others name emulated CPUs and NUMA nodes)."""
    managers = (topology_config(node, EVICTION_MEMORY_MIB) if emulate_topology
                else {"topologyManagerPolicy": node.topology_manager_policy})
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
        # the CPU, topology and memory managers as the profile says (on the emulated
        # machine: the kubelet runs in kubeletns's namespace)
        **managers,
        "featureGates": feature_gates,
        "failSwapOn": False,
        "makeIPTablesUtilChains": False,  # leave the host's iptables alone
        "podLogsDir": str(layout.state / "pod-logs"),
        "volumePluginDir": str(layout.kubelet / "volume-plugins"),
        "resolvConf": "/etc/resolv.conf",
        "clusterDomain": "cluster.local",
        "serializeImagePulls": False,
        # the node status recomputed every second (posted when it changed), as in kind
        # (kind-config/cluster.yaml): a fault shows in allocatable in ~1-2 s, not up to 10
        "nodeStatusUpdateFrequency": "1s",
        "evictionHard": {
            "memory.available": f"{EVICTION_MEMORY_MIB}Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
    }
