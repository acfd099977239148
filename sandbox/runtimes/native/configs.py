"""containerd, CNI and kubelet configuration for the native runtime's node."""

from __future__ import annotations

from typing import Any

from sandbox.profile.spec import NodeSpec
from sandbox.runtimes.native.common import BRIDGE, CNI_BIN_DIR, PAUSE_REF, POD_SUBNET, Layout


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
