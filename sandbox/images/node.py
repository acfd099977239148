"""kind node and agent base images built from local files only (no container registry).

For machines with no registry (air-gapped CI, this project's build machines). Users with a
registry run stock ``kindest/node`` images and never need this. Everything is built the
way kind builds its own images (``images/base`` and ``pkg/build/nodeimage`` of the pinned
kind module), from:

- a Debian rootfs made by ``mmdebstrap`` from Debian packages (kind's package list plus
  Debian's runc and CNI plugins, and its containerd 1.6, which the image does not run);
- containerd 2.x as ``scripts/build-containerd`` builds it (the native runtime's), in
  ``/usr/local/bin`` where kind's units look: with CDI built in, so a DRA driver's devices
  reach pods as on stock kindest/node images (Debian's 1.6 has no CDI);
- kind's base files (entrypoint, systemd units, containerd config) read at build time
  from the kind module in the Go module cache, never committed;
- the Kubernetes binaries ``scripts/build-k8s`` builds (kubeadm, kubelet, kubectl, the
  control-plane components, etcd) and our own pause program, each control-plane
  component as a one-binary image preloaded into the node's containerd, as kind does.

The node image is the *minimal shape*: no CNI daemon (kindnetd) and no CoreDNS images
(building each costs ~20 min on 2 cores). Pod networking comes from a static bridge CNI
config baked into the image; the image says so in the label ``SHAPE_LABEL`` and the kind
runtime then creates clusters with ``disableDefaultCNI`` (and scales CoreDNS to zero).
kube-proxy runs (our binary on the agent's Debian rootfs, for iptables), so Services
work within a node and pods reach the API server; there is no cluster DNS, and pods on
different nodes do not reach each other.

The rootfs tarballs are ``rootfs.py`` (standard library only: ``python3 -m
sandbox.images.rootfs`` runs before anything is installed); ``python -m
sandbox.images.node node`` builds the images (``agent-base``: the agent's base image,
``agent.build_agent_base``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from sandbox.cache import CONTAINERD_TOOLS, CONTAINERD_VERSION, cache_root
from sandbox.commands import run
from sandbox.errors import ImageBuildError, SandboxError
from sandbox.images import agent, deps, dockerload, oci, rootfs, tarfiles
from sandbox.images.agent import KEY_LABEL, build_agent_base
from sandbox.images.dockerload import docker_load, image_label
from sandbox.images.oci import PATH, write_archive
from sandbox.images.pause import pause_image
from sandbox.images.rootfs import AGENT_PACKAGES, NODE_PACKAGES, build_rootfs, say
from sandbox.images.tarfiles import layer_tar
from sandbox.progress import Progress

KIND_VERSION = "v0.32.0"
K8S_VERSION = "1.37.2"

NODE_IMAGE = f"hw-sandbox/kind-node:v{K8S_VERSION}"
SHAPE_LABEL = "dev.hwsandbox.kind.shape"

# Static pod networking for the minimal shape (a CNI config named "kindnet" as kind's
# own, so containerd and kind's tooling treat it as the cluster network). Each node
# bridges its pods privately and masquerades what leaves the node (so the API server's
# Service, through kube-proxy, answers); pods on different nodes do not reach each other.
CNI_CONFLIST = {
    "cniVersion": "0.4.0",
    "name": "kindnet",
    "plugins": [
        {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/16"}]],
                  "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ],
}
STORAGE_MANIFEST = """\
# minimal shape: a default StorageClass with no provisioner running (no image to build)
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: standard
  annotations:
    storageclass.kubernetes.io/is-default-class: "true"
provisioner: rancher.io/local-path
volumeBindingMode: WaitForFirstConsumer
"""

# --- kind's base files ------------------------------------------------------------------------

def kind_module_dir() -> Path:
    """sigs.k8s.io/kind at KIND_VERSION in the Go module cache (downloaded if missing)."""
    go = shutil.which("go")
    if go is None:
        raise ImageBuildError("kind base files: the Go toolchain is needed to fetch "
                              f"sigs.k8s.io/kind@{KIND_VERSION} (https://go.dev/doc/install)")
    out = run([go, "mod", "download", "-json", f"sigs.k8s.io/kind@{KIND_VERSION}"],
              step="kind base files", timeout=None).stdout
    directory = Path(json.loads(out)["Dir"])
    if not (directory / "images" / "base" / "files").is_dir():
        raise ImageBuildError(f"kind base files: {directory}/images/base/files is missing")
    return directory


def _basefiles_layer(kind_dir: Path) -> bytes:
    """kind's images/base/files as a layer, with the modes kind's Dockerfile gives them."""
    files = kind_dir / "images" / "base" / "files"
    found = {p.relative_to(files).as_posix(): p for p in files.rglob("*")}
    return layer_tar({rel: p for rel, p in found.items() if not p.is_dir()},
                     {rel for rel in found if rel.startswith(("usr/local/bin/", "kind/bin/"))},
                     dirs=[rel for rel, p in found.items() if p.is_dir()])


# --- control-plane images ---------------------------------------------------------------------

def _k8s_bin_dir() -> Path:
    return cache_root() / "k8s" / f"v{K8S_VERSION}" / "bin"


def _containerd_bin_dir() -> Path:
    return cache_root() / "containerd" / f"v{CONTAINERD_VERSION}" / "bin"


def component_images(bin_dir: Path, work: Path, progress: Progress) -> list[Path]:
    """OCI archives of every image kubeadm needs that the minimal shape runs."""
    listed = run([str(bin_dir / "kubeadm"), "config", "images", "list",
                  "--kubernetes-version", f"v{K8S_VERSION}"], step="images",
                 timeout=None).stdout.split()
    archives: list[Path] = []
    passwd = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"
    for ref in listed:
        repo = ref.rsplit(":", 1)[0].rsplit("/", 1)[-1]
        if repo == "pause":
            archives.append(pause_image(work, ref))
            continue
        if repo == "coredns":
            continue  # minimal shape: no cluster DNS (see module doc)
        binary = bin_dir / repo
        if not binary.is_file():
            raise ImageBuildError(f"images: {binary} is missing (run scripts/build-k8s)")
        dest = work / f"{repo}.oci.tar"
        if repo == "kube-proxy":
            # needs iptables and conntrack: the agent's Debian rootfs (a layer the node
            # image preloads anyway) plus the binary
            entry = "/usr/local/bin/kube-proxy"
            write_archive(dest, ref, [build_rootfs("agent", AGENT_PACKAGES, progress),
                                      layer_tar({entry: binary}, {entry})],
                          {"Env": [PATH], "Entrypoint": [entry]})
            archives.append(dest)
            progress(f"image {ref} ({binary.stat().st_size >> 20} MiB + the agent rootfs)")
            continue
        layer = layer_tar({f"/usr/local/bin/{repo}": binary, "/etc/passwd": passwd},
                          {f"/usr/local/bin/{repo}"}, dirs={"/tmp", "/var/lib"})
        write_archive(dest, ref, [layer], {"Env": [PATH], "Entrypoint": [f"/usr/local/bin/{repo}"]})
        archives.append(dest)
        progress(f"image {ref} ({binary.stat().st_size >> 20} MiB)")
    # containerd's sandbox image (kind's containerd config pins its own pause tag)
    archives.append(pause_image(work, "registry.k8s.io/pause:3.10"))
    return archives


SETUP_SCRIPT = r"""
set -eu
# Debian installs runc under /usr; kind's units and config expect /usr/local (containerd is
# ours there already).
mkdir -p /usr/local/sbin /opt/cni/bin && ln -sf /usr/sbin/runc /usr/local/sbin/runc
for p in /usr/lib/cni/*; do ln -sf "$p" /opt/cni/bin/; done
hook='{"path": "/kind/bin/mount-product-files.sh"}'
ctr oci spec \
  | jq ".hooks.createContainer[.hooks.createContainer| length] |= . + $hook" \
  | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json
# as kind's images/base Dockerfile
find /lib/systemd/system/sysinit.target.wants/ -name systemd-tmpfiles-setup.service -delete
rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \
      /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \
      /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/*
echo "ReadKMsg=no" >> /etc/systemd/journald.conf
ln -sf /usr/lib/systemd/systemd /sbin/init
systemctl enable kubelet.service containerd.service undo-mount-hacks.service >/dev/null 2>&1
systemctl mask systemd-binfmt.service >/dev/null 2>&1
mkdir -p /etc/kubernetes/manifests /kind/manifests /etc/cni/net.d
# containerd for the image imports that follow (piped in with docker exec -i); in the
# background of this `docker exec`, which returns once this script has
containerd >/tmp/containerd.log 2>&1 < /dev/null &
for i in $(seq 100); do [ -S /run/containerd/containerd.sock ] && break; sleep 0.1; done
ctr version >/dev/null
"""


def build_node_image(progress: Progress = say, *, force: bool = False) -> str:
    """The kind node image ``NODE_IMAGE`` (built once per key); returns its ref."""
    bin_dir = _k8s_bin_dir()
    needed = ["kubeadm", "kubelet", "kubectl", "kube-apiserver", "kube-controller-manager",
              "kube-scheduler", "etcd"]
    missing = [b for b in needed if not (bin_dir / b).is_file()]
    if missing:
        raise ImageBuildError(f"node image: {', '.join(missing)} missing in {bin_dir} "
                              "(run scripts/build-k8s)")
    cbin = _containerd_bin_dir()
    missing = [t for t in CONTAINERD_TOOLS if not (cbin / t).is_file()]
    if missing:
        raise ImageBuildError(f"node image: {', '.join(missing)} missing in {cbin} (run "
                              f"scripts/build-containerd: containerd v{CONTAINERD_VERSION} with "
                              "CDI)")
    node_rootfs = build_rootfs("node", NODE_PACKAGES, progress)
    # the sandbox image's Debian and dependency layers, preloaded so that `sandbox up`
    # ships only our packages (agent.py)
    agent_layers: list[Path | bytes] = [build_rootfs("agent", AGENT_PACKAGES, progress),
                                        deps.deps_layer(progress)]
    preloaded = oci.layer_digests(agent_layers)
    # the key covers the code that writes the image
    here = b"".join(Path(m.__file__ or "").read_bytes()
                    for m in (sys.modules[__name__], rootfs, tarfiles, oci, dockerload))
    key = hashlib.sha256(b"\0".join([
        node_rootfs.name.encode(), KIND_VERSION.encode(), K8S_VERSION.encode(), here,
        *(d.encode() for d in preloaded),
        *(str((bin_dir / b).stat().st_size).encode() for b in needed),
        *(str((cbin / t).stat().st_size).encode() for t in CONTAINERD_TOOLS)])).hexdigest()[:16]
    if not force and image_label(NODE_IMAGE, KEY_LABEL) == key:
        progress(f"node image {NODE_IMAGE} is current")
        return NODE_IMAGE
    started = time.monotonic()
    kind_dir = kind_module_dir()
    base = f"hw-sandbox/kind-node-base:{key}"
    with tempfile.TemporaryDirectory(prefix="hwsb-node-image-") as tmp:
        work = Path(tmp)
        archives = component_images(bin_dir, work, progress)
        layers = work / "agent-layers.oci.tar"
        write_archive(layers, f"docker.io/hw-sandbox/agent-layers:{key}", agent_layers,
                      {"Env": agent.ENV})
        archives.append(layers)
        files: dict[str, bytes | Path] = {f"/usr/bin/{b}": bin_dir / b
                                          for b in ("kubeadm", "kubelet", "kubectl")}
        files.update({f"/usr/local/bin/{t}": cbin / t for t in CONTAINERD_TOOLS})
        files["/kind/version"] = f"v{K8S_VERSION}".encode()
        files["/kind/manifests/default-storage.yaml"] = STORAGE_MANIFEST.encode()
        files["/etc/cni/net.d/10-kindnet.conflist"] = json.dumps(CNI_CONFLIST, indent=2).encode()
        files["/kind/hwsb-setup.sh"] = SETUP_SCRIPT.encode()
        progress(f"node image: loading the rootfs ({node_rootfs.stat().st_size >> 20} MiB) "
                 "and kind's base files into Docker")
        labels = {SHAPE_LABEL: "minimal", KEY_LABEL: key,
                  agent.PRELOADED_LABEL: ",".join(preloaded),
                  "dev.hwsandbox.kind.version": KIND_VERSION,
                  "dev.hwsandbox.kubernetes.version": f"v{K8S_VERSION}"}
        docker_load(base, [node_rootfs, _basefiles_layer(kind_dir),
                           layer_tar(files, {"/usr/bin/kubeadm", "/usr/bin/kubelet",
                                             "/usr/bin/kubectl", "/kind/hwsb-setup.sh",
                                             *(f"/usr/local/bin/{t}" for t in CONTAINERD_TOOLS)})],
                    {"Env": [PATH, "container=docker"],
                     "Entrypoint": ["/usr/local/bin/entrypoint", "/sbin/init"],
                     "StopSignal": "SIGRTMIN+3", "Labels": labels})
        # containerd must run to import images: a build container, then commit (as kind does)
        progress("node image: preloading images into containerd (build container)")
        name = f"hwsb-node-build-{os.getpid()}"
        old = ""
        try:
            _preload(name, base, archives)
            images = run(["docker", "exec", name, "ctr", "--namespace=k8s.io", "images",
                          "list", "-q"], step="node image setup", timeout=None).stdout
            _finish(name)
            old = dockerload.image_id(NODE_IMAGE)
            entrypoint = 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]'
            run(["docker", "commit", "--change", entrypoint, "--change", "CMD []",
                 name, NODE_IMAGE], step="node image commit", timeout=None)
        finally:
            dockerload.remove("rm", "-f", "-v", name)
            dockerload.remove("rmi", base)
        if old:  # the image this one replaces (nothing else uses it)
            dockerload.remove("rmi", old)
    named = [i for i in images.split() if ":" in i and not i.startswith(("sha256:", "import-"))]
    progress(f"node image {NODE_IMAGE} built in {time.monotonic() - started:.0f}s "
             f"(preloaded: {', '.join(named)})")
    return NODE_IMAGE


def _preload(name: str, base: str, archives: list[Path]) -> None:
    """A build container of ``base`` with containerd running, ``archives`` imported."""
    run(["docker", "run", "-d", "--name", name, "--privileged", "--entrypoint", "sleep",
         base, "infinity"], step="node image build container", timeout=None)
    run(["docker", "exec", name, "bash", "/kind/hwsb-setup.sh"], step="node image setup",
        timeout=None)
    # piped in, as kind's importer does: archives never land in an image layer
    for archive in archives:
        with archive.open("rb") as f:
            run(["docker", "exec", "-i", name, "ctr", "--namespace=k8s.io", "images",
                 "import", "--label=io.cri-containerd.pinned=pinned", "--all-platforms",
                 "--no-unpack", "--digests", "-"], step=f"node image: import {archive.name}",
                stdin=f, timeout=None)


def _finish(name: str) -> None:
    """containerd stopped in the build container and what it leaves removed."""
    # (no init reaps containerd in the build container: wait until gone or a zombie)
    run(["docker", "exec", name, "bash", "-c", "pkill -x containerd; "
         "while ps -o stat= -C containerd | grep -qv Z; do sleep 0.1; done; "
         "rm -rf /tmp/containerd.log /var/lib/containerd/io.containerd.runtime.v2.task"],
        step="node image setup", timeout=None)
    run(["docker", "exec", name, "rm", "-f", "/kind/hwsb-setup.sh"], step="node image setup",
        timeout=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sandbox.images.node", description="Build kind node and agent base "
        "images from local files only (see the module docstring). Cached; re-running is a no-op.")
    parser.add_argument("what", choices=("rootfs", "node", "agent-base", "all"))
    parser.add_argument("--force", action="store_true", help="rebuild the node image")
    args = parser.parse_args(argv)
    try:
        if args.what == "rootfs":
            return rootfs.main([])
        if args.what in ("node", "all"):
            print(build_node_image(force=args.force))
        if args.what in ("agent-base", "all"):
            print(build_agent_base())
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
