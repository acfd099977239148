"""kind node and agent base images built from local files only (no container registry).

For machines with no registry (air-gapped CI, this project's build machines). Users with a
registry run stock ``kindest/node`` images and never need this. Everything is built the
way kind builds its own images (``images/base`` and ``pkg/build/nodeimage`` of the pinned
kind module), from:

- a Debian rootfs made by ``mmdebstrap`` from Debian packages (kind's package list plus
  Debian's containerd, runc and CNI plugins);
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

Run as a script (``python3 sandbox/runtimes/kindimage.py rootfs``) only the rootfs step
runs, with nothing but the standard library, so it can start before anything is
installed; ``python -m sandbox.runtimes.kindimage node`` builds the images.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

KIND_VERSION = "v0.32.0"
K8S_VERSION = "1.37.2"
SUITE = "bookworm"
MIRROR = os.environ.get("HWSANDBOX_DEBIAN_MIRROR", "http://deb.debian.org/debian")

NODE_IMAGE = f"hw-sandbox/kind-node:v{K8S_VERSION}"
AGENT_BASE_IMAGE = f"hw-sandbox/agent-base:{SUITE}"
SHAPE_LABEL = "dev.hwsandbox.kind.shape"
KEY_LABEL = "dev.hwsandbox.build-key"
AGENT_BASE_LABEL = "dev.hwsandbox.agent-base"  # "ready": Debian's Python 3.11 and FUSE

# kind's images/base package list (minus storage-test and NFS/iSCSI packages), plus what
# kind builds from source there, taken from Debian instead.
NODE_PACKAGES = [
    "systemd", "conntrack", "iptables", "nftables", "iproute2", "ethtool", "util-linux",
    "mount", "kmod", "libseccomp2", "pigz", "bash", "ca-certificates", "curl", "jq",
    "procps", "containerd", "runc", "containernetworking-plugins",
]
# The sandbox agent and our plugins: Debian's Python 3.11 (the wheels are cp311) and FUSE;
# iptables and conntrack for kube-proxy, whose image shares this rootfs layer.
AGENT_PACKAGES = ["python3", "libfuse3-3", "fuse3", "iptables", "conntrack"]

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

Progress = Callable[[str], None]


def cache_root() -> Path:
    base = os.environ.get("HWSANDBOX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hw-sandbox")
    return Path(base)


class BuildError(Exception):
    """A step of an image build failed; the message names the step and what to do."""


def _say(message: str) -> None:
    print(f"[kind-image {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _run(argv: list[str], step: str, *, stdin: Any = None, input_bytes: bytes | None = None,
         capture: bool = True) -> str:
    try:
        proc = subprocess.run(argv, stdin=stdin, input=input_bytes, check=False,
                              stdout=subprocess.PIPE if capture else None,
                              stderr=subprocess.PIPE)
    except FileNotFoundError as exc:
        raise BuildError(f"{step}: {argv[0]} not found") from exc
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.decode(errors="replace").strip().splitlines()[-6:])
        raise BuildError(f"{step}: `{' '.join(argv[:4])} ...` exited {proc.returncode}: {tail}")
    return proc.stdout.decode(errors="replace") if capture else ""


# --- rootfs ---------------------------------------------------------------------------------

def rootfs_key(packages: Iterable[str]) -> str:
    text = json.dumps([SUITE, MIRROR, sorted(packages)])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _rootfs_path(name: str, packages: list[str]) -> Path:
    return cache_root() / "kind" / f"rootfs-{name}-{SUITE}-{rootfs_key(packages)}.tar"


def cached_rootfs(name: str, packages: list[str]) -> Path | None:
    """The rootfs tarball if it was built before, else None (nothing is built)."""
    out = _rootfs_path(name, packages)
    return out if out.is_file() else None


def build_rootfs(name: str, packages: list[str], progress: Progress = _say) -> Path:
    """A Debian ``SUITE`` minbase rootfs with ``packages``, as a tar in the cache."""
    out = _rootfs_path(name, packages)
    if out.is_file():
        return out
    if shutil.which("mmdebstrap") is None:
        raise BuildError("rootfs: mmdebstrap not found (Debian: apt-get install mmdebstrap)")
    if os.geteuid() != 0:
        raise BuildError("rootfs: mmdebstrap runs as root here (run the build as root)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    progress(f"rootfs {name}: mmdebstrap {SUITE} + {len(packages)} packages (a few minutes)")
    started = time.monotonic()
    argv = ["mmdebstrap", "--quiet", "--mode=root", "--variant=minbase", "--format=tar",
            "--include=" + ",".join(packages),
            "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
            "--dpkgopt=path-include=/usr/share/doc/*/copyright",
            "--aptopt=APT::Install-Recommends false",
            # policy-rc.d: no service starts while packages are installed
            "--customize-hook=rm -f \"$1/usr/sbin/policy-rc.d\"",
            SUITE, str(tmp), f"deb {MIRROR} {SUITE} main"]
    try:
        _run(argv, f"rootfs {name}", capture=False)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    progress(f"rootfs {name}: {out.stat().st_size >> 20} MiB in "
             f"{time.monotonic() - started:.0f}s -> {out}")
    return out


# --- docker-archive images (docker load): full control of the image config --------------------

def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def docker_load(ref: str, layers: list[Path | bytes], config: dict[str, Any]) -> None:
    """``docker load`` an image made of uncompressed layer tars and an image config."""
    diff_ids = [hashlib.sha256(layer).hexdigest() if isinstance(layer, bytes)
                else _sha256_file(layer) for layer in layers]
    image_config = {
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in diff_ids]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "hw-sandbox"}
                    for _ in layers],
    }
    config_bytes = json.dumps(image_config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [ref],
                 "Layers": [f"{d}/layer.tar" for d in diff_ids]}]
    with tempfile.TemporaryFile() as errors, subprocess.Popen(
            ["docker", "load", "--quiet"], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=errors) as proc:
        assert proc.stdin is not None
        try:
            with tarfile.open(fileobj=proc.stdin, mode="w|") as tar:
                tar_add(tar, config_name, config_bytes)
                for digest, layer in zip(diff_ids, layers, strict=True):
                    tar_add(tar, f"{digest}/layer.tar", layer)
                tar_add(tar, "manifest.json", json.dumps(manifest).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        if proc.wait() != 0:
            errors.seek(0)
            raise BuildError(f"docker load {ref}: {errors.read().decode(errors='replace')}")


def image_label(ref: str, label: str) -> str | None:
    """A label of a local image; None when the image is absent."""
    proc = subprocess.run(["docker", "image", "inspect", ref, "--format",
                           f'{{{{index .Config.Labels "{label}"}}}}'],
                          capture_output=True, text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


# --- kind's base files ------------------------------------------------------------------------

def kind_module_dir() -> Path:
    """sigs.k8s.io/kind at KIND_VERSION in the Go module cache (downloaded if missing)."""
    go = shutil.which("go")
    if go is None:
        raise BuildError("kind base files: the Go toolchain is needed to fetch "
                         f"sigs.k8s.io/kind@{KIND_VERSION} (https://go.dev/doc/install)")
    out = _run([go, "mod", "download", "-json", f"sigs.k8s.io/kind@{KIND_VERSION}"],
               "kind base files")
    directory = Path(json.loads(out)["Dir"])
    if not (directory / "images" / "base" / "files").is_dir():
        raise BuildError(f"kind base files: {directory}/images/base/files is missing")
    return directory


def _basefiles_layer(kind_dir: Path) -> bytes:
    """kind's images/base/files as a layer, with the modes kind's Dockerfile gives them."""
    files = kind_dir / "images" / "base" / "files"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(files.rglob("*")):
            rel = path.relative_to(files).as_posix()
            info = tarfile.TarInfo(rel)
            info.mtime = 0
            if path.is_dir():
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
                continue
            data = path.read_bytes()
            info.size = len(data)
            script = rel.startswith(("usr/local/bin/", "kind/bin/"))
            info.mode = 0o755 if script else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# --- control-plane images ---------------------------------------------------------------------

def _k8s_bin_dir() -> Path:
    return cache_root() / "k8s" / f"v{K8S_VERSION}" / "bin"


def component_images(bin_dir: Path, work: Path, progress: Progress) -> list[Path]:
    """OCI archives of every image kubeadm needs that the minimal shape runs."""
    from sandbox.runtimes._images import Layer, pause_image, write_image

    listed = _run([str(bin_dir / "kubeadm"), "config", "images", "list",
                   "--kubernetes-version", f"v{K8S_VERSION}"], "images").split()
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
            raise BuildError(f"images: {binary} is missing (run scripts/build-k8s)")
        dest = work / f"{repo}.oci.tar"
        if repo == "kube-proxy":
            # needs iptables and conntrack: the agent's Debian rootfs (a layer the node
            # image preloads anyway) plus the binary
            from sandbox.runtimes.agentimage import write_archive

            entry = "/usr/local/bin/kube-proxy"
            write_archive(dest, ref, [build_rootfs("agent", AGENT_PACKAGES, progress),
                                      files_layer({entry: binary}, {entry})],
                          {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
                                   ":/sbin:/bin"], "Entrypoint": [entry]})
            archives.append(dest)
            progress(f"image {ref} ({binary.stat().st_size >> 20} MiB + the agent rootfs)")
            continue
        layer = Layer(files={f"/usr/local/bin/{repo}": binary, "/etc/passwd": passwd},
                      executables={f"/usr/local/bin/{repo}"}, dirs={"/tmp", "/var/lib"})
        write_image(dest, ref, layer, entrypoint=[f"/usr/local/bin/{repo}"])
        archives.append(dest)
        progress(f"image {ref} ({binary.stat().st_size >> 20} MiB)")
    # containerd's sandbox image (kind's containerd config pins its own pause tag)
    archives.append(pause_image(work, "registry.k8s.io/pause:3.10"))
    return archives


SETUP_SCRIPT = r"""
set -eu
# Debian installs containerd and runc under /usr; kind's units and config expect /usr/local.
for b in containerd ctr containerd-shim-runc-v2; do ln -sf /usr/bin/$b /usr/local/bin/$b; done
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
# containerd for the image imports that follow (piped in with docker exec -i)
setsid containerd >/tmp/containerd.log 2>&1 < /dev/null &
for i in $(seq 100); do [ -S /run/containerd/containerd.sock ] && break; sleep 0.1; done
ctr version >/dev/null
"""


def tar_add(tar: tarfile.TarFile, name: str, data: bytes | Path) -> None:
    """One regular file in ``tar``, streamed from ``data`` (bytes, or a file here)."""
    info = tarfile.TarInfo(name)
    if isinstance(data, bytes):
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    else:
        info.size = data.stat().st_size
        with data.open("rb") as f:
            tar.addfile(info, f)


def files_layer(files: dict[str, bytes | Path], executables: set[str] | None = None) -> bytes:
    """A deterministic layer tar (parents included, mtime 0, owned by root) of ``files``:
    path in the image -> bytes or a file here. A file here that is a symlink stays one.
    Mode 0755 for paths in ``executables`` (None: a file here keeps its own x bit)."""
    buf = io.BytesIO()
    dirs: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files, key=lambda n: n.strip("/")):
            parts = name.strip("/").split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
                    tar.addfile(info)
            content = files[name]
            info = tarfile.TarInfo(name.strip("/"))
            info.mtime = 0
            if isinstance(content, Path) and content.is_symlink():
                info.type, info.linkname, info.mode = (tarfile.SYMTYPE, os.readlink(content),
                                                       0o777)
                tar.addfile(info)
                continue
            if executables is None:
                executable = isinstance(content, Path) and os.access(content, os.X_OK)
            else:
                executable = name in executables
            info.mode = 0o755 if executable else 0o644
            data = content.read_bytes() if isinstance(content, Path) else content
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def build_node_image(progress: Progress = _say, *, force: bool = False) -> str:
    """The kind node image ``NODE_IMAGE`` (built once per key); returns its ref."""
    bin_dir = _k8s_bin_dir()
    needed = ["kubeadm", "kubelet", "kubectl", "kube-apiserver", "kube-controller-manager",
              "kube-scheduler", "etcd"]
    missing = [b for b in needed if not (bin_dir / b).is_file()]
    if missing:
        raise BuildError(f"node image: {', '.join(missing)} missing in {bin_dir} "
                         "(run scripts/build-k8s)")
    rootfs = build_rootfs("node", NODE_PACKAGES, progress)
    # the sandbox image's Debian and dependency layers, preloaded so that `sandbox up`
    # ships only our packages (sandbox/runtimes/agentimage.py)
    from sandbox.runtimes.agentimage import (
        ENV,
        PRELOADED_LABEL,
        deps_layer,
        layer_digests,
        write_archive,
    )

    agent_layers: list[Path | bytes] = [build_rootfs("agent", AGENT_PACKAGES, progress),
                                        deps_layer(progress)]
    preloaded = layer_digests(agent_layers)
    here = Path(__file__).read_bytes()
    key = hashlib.sha256(b"\0".join([
        rootfs.name.encode(), KIND_VERSION.encode(), K8S_VERSION.encode(), here,
        *(d.encode() for d in preloaded),
        *(str((bin_dir / b).stat().st_size).encode() for b in needed)])).hexdigest()[:16]
    if not force and image_label(NODE_IMAGE, KEY_LABEL) == key:
        progress(f"node image {NODE_IMAGE} is current")
        return NODE_IMAGE
    started = time.monotonic()
    kind_dir = kind_module_dir()
    base = f"hw-sandbox/kind-node-base:{key}"
    with tempfile.TemporaryDirectory(prefix="hwsb-node-image-") as tmp:
        work = Path(tmp)
        archives = component_images(bin_dir, work, progress)
        agent = work / "agent-layers.oci.tar"
        write_archive(agent, f"docker.io/hw-sandbox/agent-layers:{key}", agent_layers,
                      {"Env": ENV})
        archives.append(agent)
        files: dict[str, bytes | Path] = {f"/usr/bin/{b}": bin_dir / b
                                          for b in ("kubeadm", "kubelet", "kubectl")}
        files["/kind/version"] = f"v{K8S_VERSION}".encode()
        files["/kind/manifests/default-storage.yaml"] = STORAGE_MANIFEST.encode()
        files["/etc/cni/net.d/10-kindnet.conflist"] = json.dumps(CNI_CONFLIST, indent=2).encode()
        files["/kind/hwsb-setup.sh"] = SETUP_SCRIPT.encode()
        progress(f"node image: loading the rootfs ({rootfs.stat().st_size >> 20} MiB) "
                 "and kind's base files into Docker")
        labels = {SHAPE_LABEL: "minimal", KEY_LABEL: key, PRELOADED_LABEL: ",".join(preloaded),
                  "dev.hwsandbox.kind.version": KIND_VERSION,
                  "dev.hwsandbox.kubernetes.version": f"v{K8S_VERSION}"}
        docker_load(base, [rootfs, _basefiles_layer(kind_dir),
                           files_layer(files, {"/usr/bin/kubeadm", "/usr/bin/kubelet",
                                                "/usr/bin/kubectl", "/kind/hwsb-setup.sh"})],
                    {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                             "container=docker"],
                     "Entrypoint": ["/usr/local/bin/entrypoint", "/sbin/init"],
                     "StopSignal": "SIGRTMIN+3", "Labels": labels})
        # containerd must run to import images: a build container, then commit (as kind does)
        progress("node image: preloading images into containerd (build container)")
        name = f"hwsb-node-build-{os.getpid()}"
        old = ""
        try:
            _run(["docker", "run", "-d", "--name", name, "--privileged", "--entrypoint", "sleep",
                  base, "infinity"], "node image build container")
            _run(["docker", "exec", name, "bash", "/kind/hwsb-setup.sh"], "node image setup")
            # piped in, as kind's importer does: archives never land in an image layer
            for archive in archives:
                with archive.open("rb") as f:
                    _run(["docker", "exec", "-i", name, "ctr", "--namespace=k8s.io", "images",
                          "import", "--label=io.cri-containerd.pinned=pinned", "--all-platforms",
                          "--no-unpack", "--digests", "-"], f"node image: import {archive.name}",
                         stdin=f)
            images = _run(["docker", "exec", name, "ctr", "--namespace=k8s.io", "images", "list",
                           "-q"], "node image setup")
            # (no init reaps containerd in the build container: wait until gone or a zombie)
            _run(["docker", "exec", name, "bash", "-c", "pkill -x containerd; "
                  "while ps -o stat= -C containerd | grep -qv Z; do sleep 0.1; done; "
                  "rm -rf /tmp/containerd.log /var/lib/containerd/io.containerd.runtime.v2.task"],
                 "node image setup")
            _run(["docker", "exec", name, "rm", "-f", "/kind/hwsb-setup.sh"], "node image setup")
            old = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", NODE_IMAGE],
                                 capture_output=True, text=True, check=False).stdout.strip()
            _run(["docker", "commit", "--change",
                  'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]', "--change", "CMD []",
                  name, NODE_IMAGE], "node image commit")
        finally:
            subprocess.run(["docker", "rm", "-f", "-v", name], capture_output=True, check=False)
            subprocess.run(["docker", "rmi", base], capture_output=True, check=False)
        if old:  # the image this one replaces (nothing else uses it)
            subprocess.run(["docker", "rmi", old], capture_output=True, check=False)
    named = [i for i in images.split() if ":" in i and not i.startswith(("sha256:", "import-"))]
    progress(f"node image {NODE_IMAGE} built in {time.monotonic() - started:.0f}s "
             f"(preloaded: {', '.join(named)})")
    return NODE_IMAGE


def build_agent_base(progress: Progress = _say) -> str:
    """The sandbox agent's base ``AGENT_BASE_IMAGE``: Debian, Python 3.11 and FUSE."""
    rootfs = build_rootfs("agent", AGENT_PACKAGES, progress)
    key = f"{rootfs.name}+ready"
    if image_label(AGENT_BASE_IMAGE, KEY_LABEL) == key:
        return AGENT_BASE_IMAGE
    progress(f"agent base image: loading {rootfs.name} into Docker")
    docker_load(AGENT_BASE_IMAGE, [rootfs],
                {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                 "Cmd": ["python3"], "Labels": {KEY_LABEL: key, AGENT_BASE_LABEL: "ready"}})
    return AGENT_BASE_IMAGE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kindimage", description="Build kind node and agent base images from local "
        "files only (see the module docstring). Cached; re-running is a no-op.")
    parser.add_argument("what", choices=("rootfs", "node", "agent-base", "all"))
    parser.add_argument("--force", action="store_true", help="rebuild the node image")
    args = parser.parse_args(argv)
    try:
        if args.what == "rootfs":
            # the two mmdebstrap runs are mostly downloads and dpkg: run them side by side
            with __import__("concurrent.futures").futures.ThreadPoolExecutor(2) as pool:
                jobs = [pool.submit(build_rootfs, "node", NODE_PACKAGES),
                        pool.submit(build_rootfs, "agent", AGENT_PACKAGES)]
                for job in jobs:
                    job.result()
        if args.what in ("node", "all"):
            print(build_node_image(force=args.force))
        if args.what in ("agent-base", "all"):
            print(build_agent_base())
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        # run as a file: only the stdlib-only steps are reachable without the package
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
