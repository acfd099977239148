"""Issue 25 on kind, where users are: a plugin author's own image, loaded without a
registry and run from `sandbox plugins template`'s DaemonSet; and the exec transport that
serves Docker Desktop and remote Docker hosts, forced here with the host's sockets hidden.
On the 8gpu-2numa sandbox (our plugin advertising) test_kind.py used before (``demo_gpu``):
its tests leave it as found (no fault, no pod, 8 GPUs advertised), the last takes it down."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.kind_e2e.conftest import DEMO_NAME, REPO, KindSandbox, leftovers

NAME = DEMO_NAME
GPU = "nvidia.com/gpu"


@pytest.fixture
def gpu(demo_gpu: KindSandbox) -> KindSandbox:
    return demo_gpu


PLUGIN_IMAGE = "hwsb.test/my-plugin:v1"  # a domain of its own: no docker.io/ prefix
ARCHIVE_IMAGE = "hwsb.test/my-plugin:archive"
PLUGIN_SCRIPT = (  # what a plugin reads, printed as key=value
    'echo "devnodes=$(ls -d /dev/nvidia[0-9]* | wc -l)"; '
    'echo "nvidia_functions=$(grep -l 0x10de /sys/bus/pci/devices/*/vendor | wc -l)"; '
    'echo "tree_numbers=$(stat -c %t:%T /hw-sandbox/root/dev/nvidia0)"; '
    'echo "proc_driver=$(head -1 /hw-sandbox/root/proc/driver/nvidia/version)"; '
    'echo "kubelet_sock=$(ls /var/lib/kubelet/device-plugins/kubelet.sock)"; '
    "echo ready; exec sleep 3600")


def _busybox_rootfs(dest: Path) -> Path:
    """A rootfs tarball of Debian's static busybox (`docker import` makes an image of it):
    a plugin author's image, built here from local files (there is no registry)."""
    from sandbox.images.pause import BUSYBOX
    from sandbox.images.tarfiles import layer_tar

    if not BUSYBOX.is_file():
        pytest.fail(f"{BUSYBOX} missing: apt-get install busybox-static (scripts/build-k8s)")
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    dest.write_bytes(layer_tar({"/bin/busybox": BUSYBOX}, {"/bin/busybox"},
                               symlinks={f"/bin/{a}": "busybox" for a in applets
                                         if a != "busybox"},
                               dirs={"/tmp", "/dev", "/proc", "/sys", "/var/lib/kubelet"}))
    return dest


def test_plugin_image_loaded_and_run_from_the_template(gpu: KindSandbox,
                                                       tmp_path: Path) -> None:
    """Issue 25: a plugin author's image, never in a registry: `sandbox load` puts it (a
    Docker image; an OCI archive) into the nodes, and the DaemonSet of `sandbox plugins
    template`, deployed with `sandbox plugins deploy FILE`, runs it on the GPU node with
    the fake /sys at /sys, the node's stand-in /dev/nvidiaN at /dev, the whole tree at
    /hw-sandbox/root and the kubelet's socket dir; a fault shows inside it live."""
    from sandbox.images.pause import busybox_image

    env = gpu.kenv.env
    subprocess.run(["docker", "import", "--change", 'CMD ["sh"]',
                    str(_busybox_rootfs(tmp_path / "rootfs.tar")), PLUGIN_IMAGE],
                   check=True, capture_output=True, env=env, timeout=300)
    try:
        loaded = gpu.sandbox("load", PLUGIN_IMAGE, "--name", NAME)
        assert f"loading {PLUGIN_IMAGE} into kind cluster {NAME}" in loaded.stderr, \
            loaded.stderr
        archive = busybox_image(tmp_path, ARCHIVE_IMAGE)
        loaded = gpu.sandbox("load", "--archive", str(archive), "--name", NAME)
        assert f"loading {archive} into kind cluster {NAME}" in loaded.stderr, loaded.stderr
    finally:
        subprocess.run(["docker", "rmi", PLUGIN_IMAGE], capture_output=True, env=env,
                       check=False, timeout=120)
    # the archive's image runs as it was loaded (imagePullPolicy Never: no registry asked)
    out = gpu.run_pod({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "from-archive"},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "c", "image": ARCHIVE_IMAGE, "imagePullPolicy": "Never",
            "command": ["sh", "-c", "echo loaded-from-archive"]}]},
    })
    assert "loaded-from-archive" in out, out
    gpu.kubectl("delete", "pod", "from-archive", "--wait=true")

    manifest = tmp_path / "my-plugin.yaml"
    gpu.sandbox("plugins", "template", "--image", PLUGIN_IMAGE, "--command", "/bin/sh -c",
                f"--args={shlex.quote(PLUGIN_SCRIPT)}", "-o", str(manifest))
    gpu.sandbox("plugins", "deploy", str(manifest), "--name", NAME)
    ds = ("-n", "kube-system", "daemonset/my-plugin")
    faulted = False
    try:
        gpu.wait_for("the plugin pod says ready", lambda: "ready" in gpu.kubectl(
            "logs", *ds, check=False).split(), timeout=180, interval=1)
        said = dict(line.split("=", 1) for line in gpu.kubectl("logs", *ds).splitlines()
                    if "=" in line)
        pods = json.loads(gpu.kubectl("-n", "kube-system", "get", "pods", "-l",
                                      "app.kubernetes.io/name=my-plugin", "-o", "json"))["items"]
        # only the node the sandbox serves (hwsandbox.dev/node), not the control plane
        assert [p["spec"]["nodeName"] for p in pods] == \
            [gpu.nodes()["gpu-worker"]["metadata"]["name"]], pods
        root = gpu.state_dir / "nodes" / "gpu-worker" / "root"  # the same tree, on the host
        nvidia = [v for v in (root / "sys/bus/pci/devices").glob("*/vendor")
                  if v.read_text().strip() == "0x10de"]
        st = (root / "dev" / "nvidia0").stat()
        assert said == {
            "devnodes": "8",
            "nvidia_functions": str(len(nvidia)),
            "tree_numbers": f"{os.major(st.st_rdev):x}:{os.minor(st.st_rdev):x}",
            "proc_driver": (root / "proc/driver/nvidia/version").read_text().splitlines()[0],
            "kubelet_sock": "/var/lib/kubelet/device-plugins/kubelet.sock",
        }, said
        assert len(nvidia) >= 8, nvidia
        # a fault reaches the running pod's /sys (HostToContainer propagation of the tree)
        bdf = next(d["pci_address"] for n in json.loads(gpu.sandbox(
            "status", "--name", NAME, "-o", "json").stdout)["nodes"]
            if n["name"] == "gpu-worker" for d in n["devices"] if d["id"] == "gpu2")
        aer = f"/sys/bus/pci/devices/{bdf}/aer_dev_fatal"
        before = gpu.kubectl("exec", *ds, "--", "cat", aer)
        assert before == (root / aer.removeprefix("/")).read_text()
        gpu.sandbox("fault", "--name", NAME, "health", "gpu-worker", "gpu2", "unhealthy",
                    "--reason", "aer-fatal")
        faulted = True
        gpu.wait_for("the pod reads the fault's AER counters", lambda: gpu.kubectl(
            "exec", *ds, "--", "cat", aer) != before, timeout=30)
        assert gpu.kubectl("exec", *ds, "--", "cat", aer) == \
            (root / aer.removeprefix("/")).read_text()
    finally:
        if faulted:
            gpu.sandbox("fault", "--name", NAME, "health", "gpu-worker", "gpu2", "healthy",
                        check=False)
        gpu.kubectl("delete", *ds, "--wait=true", check=False)
    gpu.wait_resource("gpu-worker", GPU, (8, 8), timeout=30)  # as the next tests expect


# -- issue 25: the exec transport (Docker Desktop, a remote Docker host) -------------------

def _through_exec(sb: KindSandbox, *args: str, check: bool = True,
                  ) -> subprocess.CompletedProcess[str]:
    """`sandbox ARGS` with the exec transport forced, in a mount namespace of its own whose
    state dir has its node directories (the host transport's sockets, as on Docker Desktop
    where they cannot be connected to) hidden under an empty tmpfs: only the relay through
    each node's agent pod can answer."""
    env = dict(sb.kenv.env, SANDBOX_TRANSPORT="exec")
    script = 'mount -t tmpfs -o size=1m,mode=0700 hidden "$0" && exec "$@"'
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           script, str(sb.state_dir / "nodes"), sys.executable, "-m",
                           "sandbox", *args], cwd=REPO, env=env, text=True,
                          capture_output=True, check=False, timeout=300)
    if check:
        assert proc.returncode == 0, f"sandbox {' '.join(args)} (exec): {proc.stderr}"
    return proc


def _status_facts(out: str) -> dict[str, object]:
    """What `status -o json` says of gpu-worker that both transports must agree on."""
    node = next(n for n in json.loads(out)["nodes"] if n["name"] == "gpu-worker")
    return {"devices": node["devices"], "resources": node["resources"],
            "allocatable": node.get("allocatable"), "allocations": node.get("allocations"),
            "notes": node.get("notes")}


def test_exec_transport_behaves_as_the_host_socket(gpu: KindSandbox) -> None:
    """Forced exec transport, host sockets out of reach: status (devices from the control
    socket, allocations from the kubelet's pod-resources API), every fault, restart-kubelet
    and dra claims do what they do through the host's sockets."""
    relays = set(Path("/tmp").glob("hwsb-relay-*"))
    gpu.wait_resource("gpu-worker", GPU, (8, 8), timeout=60)
    start = time.monotonic()
    host = gpu.sandbox("status", "--name", NAME, "-o", "json").stdout
    took_host = time.monotonic() - start
    start = time.monotonic()
    relayed = _through_exec(gpu, "status", "--name", NAME, "-o", "json").stdout
    print(f"status: host transport {took_host:.2f}s, exec {time.monotonic() - start:.2f}s")
    assert _status_facts(relayed) == _status_facts(host)
    assert _status_facts(relayed)["allocatable"], relayed  # the kubelet answered too
    # without the relay, the hidden sockets are out of reach: the namespace really hides them
    hidden = _through_exec(gpu, "status", "--name", NAME, "--transport", "host", "-o", "json")
    assert "not answering" in json.dumps(json.loads(hidden.stdout)), hidden.stdout

    out = _through_exec(gpu, "fault", "--name", NAME, "health", "gpu-worker", "gpu1",
                        "unhealthy", "--reason", "aer-fatal").stdout
    assert "gpu-worker/gpu1: unhealthy (aer-fatal) [done]" in out, out
    gpu.wait_resource("gpu-worker", GPU, (8, 7), timeout=30)
    _through_exec(gpu, "fault", "--name", NAME, "health", "gpu-worker", "gpu1", "healthy")
    gpu.wait_resource("gpu-worker", GPU, (8, 8), timeout=30)
    _through_exec(gpu, "fault", "--name", NAME, "unplug", "gpu-worker", "gpu6")
    gpu.wait_resource("gpu-worker", GPU, (7, 7), timeout=30)
    _through_exec(gpu, "fault", "--transport", "exec", "--name", NAME, "plug", "gpu-worker",
                  "gpu6")
    gpu.wait_resource("gpu-worker", GPU, (8, 8), timeout=30)
    # this profile's NICs have no SR-IOV: the server's refusal comes back the same way
    vfs = ("fault", "--name", NAME, "set-vfs", "gpu-worker", "nic0", "2")
    relayed_vfs, direct_vfs = _through_exec(gpu, *vfs, check=False), gpu.sandbox(*vfs,
                                                                                 check=False)
    assert (relayed_vfs.returncode, relayed_vfs.stderr) == \
        (direct_vfs.returncode, direct_vfs.stderr) == \
        (1, "error: set-vfs nic0: nic0 has no SR-IOV (no sriov_numvfs)\n")
    listed = json.loads(_through_exec(gpu, "fault", "--name", NAME, "list", "-o",
                                      "json").stdout)
    assert listed == json.loads(gpu.sandbox("fault", "--name", NAME, "list", "-o",
                                            "json").stdout)
    out = _through_exec(gpu, "fault", "--name", NAME, "reset", "gpu-worker").stdout
    assert "gpu-worker/gpu6: healthy [no change]" in out, out
    out = _through_exec(gpu, "fault", "--name", NAME, "restart-kubelet", "gpu-worker").stdout
    assert "plugin registration(s) back after" in out, out
    gpu.wait_resource("gpu-worker", GPU, (8, 8), timeout=120)
    claims = _through_exec(gpu, "dra", "claims", "--name", NAME, check=False)
    direct = gpu.sandbox("dra", "claims", "--name", NAME, check=False)
    assert (claims.returncode, claims.stdout) == (direct.returncode, direct.stdout)
    assert "Traceback" not in claims.stderr
    # every relay's private directory went with its command
    assert set(Path("/tmp").glob("hwsb-relay-*")) == relays


def test_down_leaves_nothing(gpu: KindSandbox) -> None:
    gpu.sandbox("down", "--name", NAME)
    assert leftovers(NAME, gpu.before) == []
    again = gpu.sandbox("down", "--name", NAME, check=False)  # a CI teardown step, twice
    assert again.returncode == 0, again.stderr
