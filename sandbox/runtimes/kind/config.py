"""kind cluster configs generated from a profile (templates in ``kind-config/``).

One kind node per profile node replica, labelled ``hwsandbox.dev/node=<replica>`` (how
the runtime finds a replica's node in the API), with ``<state>/nodes/<replica>`` bound at
``/var/lib/hw-sandbox`` (how it finds the node's container to place the replica's agent
pod in); a control-plane node is added when the profile has none. The templates ship
inside the package (a copy of the repository's ``kind-config/``) so an installed sandbox
finds them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from sandbox.profile.spec import Cluster
from sandbox.runtimes.kind import topology as kindtopology

NODE_LABEL = "hwsandbox.dev/node"


def _template(name: str) -> str:
    repo = Path(__file__).resolve().parents[3] / "kind-config" / name
    if repo.is_file():
        return repo.read_text()
    return resources.files("sandbox.data.kindconfig").joinpath(name).read_text()


def _fill(obj: Any, values: dict[str, str]) -> Any:
    if isinstance(obj, dict):
        return {_fill(k, values): _fill(v, values) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, values) for v in obj]
    if isinstance(obj, str):
        for key, value in values.items():
            obj = obj.replace("{" + key + "}", value)
        return obj
    return obj


@dataclass(frozen=True)
class HostFacts:
    """What the Docker host and the node image need from the generated config.

    ``cgroup_v1``: the host runs cgroup v1; kubelet >= 1.35 refuses it unless told
    ``failCgroupV1: false``. ``restrict_oom``: the host cannot grant CAP_SYS_RESOURCE, so
    containerd in the node must not lower oom_score_adj (what kind does when rootless).
    ``minimal``: the node image is the minimal shape (no CNI daemon, no CoreDNS; see
    sandbox/images/node.py), so kind must not install its default CNI.
    """

    cgroup_v1: bool = False
    restrict_oom: bool = False
    minimal: bool = False


def kind_config(cluster: Cluster, name: str, host_state_dir: Path,
                image: str | None = None, host: HostFacts = HostFacts()) -> dict[str, Any]:
    """The kind Cluster document for ``cluster``; node host dirs live under the state dir."""
    base: dict[str, Any] = yaml.safe_load(_template("cluster.yaml"))
    node_tmpl: dict[str, Any] = yaml.safe_load(_template("node.yaml"))
    config = copy.deepcopy(base)
    config["name"] = name
    nodes: list[dict[str, Any]] = []
    replicas = list(cluster.nodes)
    if not any(n.role == "control-plane" for n in replicas):
        nodes.append({"role": "control-plane"})
    for spec in replicas:
        node = _fill(node_tmpl, {
            "role": spec.role,
            "replica": spec.name,
            "host_dir": str(host_state_dir / "nodes" / spec.name),
        })
        node["labels"].update(dict(spec.labels))
        nodes.append(node)
    for node in nodes:
        if image:
            node["image"] = image
        # the cpuset-mapping runc wrapper (topology.py), on every node
        node.setdefault("extraMounts", []).append(kindtopology.bin_mount(host_state_dir))
    # kind orders control planes first when naming; keep the document in that order too.
    config["nodes"] = sorted(nodes, key=lambda n: 0 if n["role"] == "control-plane" else 1)
    if host.cgroup_v1:
        config.setdefault("kubeadmConfigPatches", []).append(
            "kind: KubeletConfiguration\nfailCgroupV1: false\n")
    config.setdefault("containerdConfigPatches", []).append(kindtopology.containerd_patch())
    if host.restrict_oom:
        config.setdefault("containerdConfigPatches", []).append(
            '[plugins."io.containerd.grpc.v1.cri"]\n  restrict_oom_score_adj = true')
    if host.minimal:
        config["networking"] = {**config.get("networking", {}), "disableDefaultCNI": True}
    return config


def kind_config_text(cluster: Cluster, name: str, host_state_dir: Path,
                     image: str | None = None, host: HostFacts = HostFacts()) -> str:
    return yaml.safe_dump(kind_config(cluster, name, host_state_dir, image, host),
                          sort_keys=False)
