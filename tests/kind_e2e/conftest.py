"""The kind runtime end to end: real Docker, real kind v0.32.0, real Kubernetes v1.37.2.

Everything is built here from package registries only (no container registry): the node
image (``sandbox.images.node``: a Debian rootfs by mmdebstrap, kind's base files
from its Go module, our Go-built Kubernetes), the agent base image, kind itself. Missing
prerequisites FAIL with the command that fixes them; nothing is skipped.

Docker: the daemon ``DOCKER_HOST`` names (``scripts/test`` starts one with
``scripts/test-dockerd``), else the default socket. Run alone::

    scripts/build-k8s && scripts/build-containerd && eval "$(scripts/test-dockerd start)" &&
    tox -e kind-e2e

Every sandbox here lives in a private state root (``HWSANDBOX_STATE_DIR``), and every
``down`` is checked: no container, network, mount or state may remain.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from tests.support import steps  # noqa: E402
from tests.support.gotools import cache_root, go_install  # noqa: E402

KIND_VERSION = "v0.32.0"
STATE_ROOT = Path("/run/hwsb-kind-e2e")


def docker_ok() -> bool:
    return subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"],
                          capture_output=True, check=False).returncode == 0


@dataclass
class KindEnv:
    env: dict[str, str]
    node_image: str
    bin_dir: Path

    def sandbox(self, *args: str, timeout: float = 900, check: bool = True,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([sys.executable, "-m", "sandbox", *args], cwd=REPO, text=True,
                              capture_output=True, check=False, timeout=timeout,
                              env=env or self.env)
        if check:
            assert proc.returncode == 0, (
                f"sandbox {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
        return proc


@pytest.fixture(scope="session")
def kind_env() -> KindEnv:
    if os.geteuid() != 0:
        pytest.fail("the kind tests run as root (they start containers and mount FUSE)")
    if shutil.which("docker") is None or not docker_ok():
        pytest.fail("no Docker daemon answers: start one with `eval \"$(scripts/test-dockerd "
                    "start)\"` (Debian: apt-get install docker.io)")
    bin_dir = cache_root() / "k8s" / "v1.37.2" / "bin"
    if not (bin_dir / "kubeadm").is_file() or not (bin_dir / "kubectl").is_file():
        pytest.fail(f"no kubeadm/kubectl in {bin_dir}: run scripts/build-k8s")
    kind = go_install("sigs.k8s.io/kind", KIND_VERSION, "kind")
    from sandbox.errors import SandboxError
    from sandbox.images.agent import build_agent_base
    from sandbox.images.node import build_node_image

    try:
        image = build_node_image(print)
        build_agent_base(print)
        # idempotent: a second build finds the image current (keyed by versions)
        said: list[str] = []
        assert build_node_image(said.append) == image
        assert f"node image {image} is current" in said, said
    except SandboxError as exc:
        pytest.fail(f"building the kind images failed: {exc}")
    env = dict(os.environ, PATH=f"{kind.parent}:{bin_dir}:{os.environ['PATH']}",
               HWSANDBOX_STATE_DIR=str(STATE_ROOT))
    env.pop("SANDBOX_KIND_IMAGE", None)
    os.environ.update(PATH=env["PATH"], HWSANDBOX_STATE_DIR=str(STATE_ROOT))
    kenv = KindEnv(env, image, bin_dir)
    # An earlier run that was killed (or failed in a teardown) can have left sandboxes in
    # this private state root: take them down as a user would, so that this run starts
    # from nothing (up() still asserts that nothing of its name is left).
    for stale in sorted(STATE_ROOT.iterdir()) if STATE_ROOT.is_dir() else []:
        print(f"taking down sandbox {stale.name}, left by an earlier run")
        proc = kenv.sandbox("down", "--name", stale.name, check=False)
        if proc.returncode != 0:
            pytest.fail(f"sandbox {stale.name} is left from an earlier run and `sandbox down "
                        f"--name {stale.name}` failed:\n{proc.stderr}")
    return kenv


@dataclass
class KindSandbox:
    kenv: KindEnv
    name: str
    profile: Path
    up_seconds: float
    # host_footprint() before its up: what down must leave as it found it
    before: frozenset[str] | None = None

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT / self.name

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    def sandbox(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.kenv.sandbox(*args, **kw)

    def kubectl(self, *args: str, input_text: str | None = None, check: bool = True,
                timeout: float = 120) -> str:
        with steps.timed(f"{self.name}: kubectl {' '.join(args)}"[:120]):
            proc = subprocess.run(["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
                                  input=input_text, text=True, capture_output=True,
                                  check=False, env=self.kenv.env, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def nodes(self) -> dict[str, dict[str, Any]]:
        """hwsandbox.dev/node label (or node name) -> node object."""
        items = json.loads(self.kubectl("get", "nodes", "-o", "json"))["items"]
        return {i["metadata"]["labels"].get("hwsandbox.dev/node", i["metadata"]["name"]): i
                for i in items}

    def resource(self, node: str, resource: str) -> tuple[int, int]:
        status = self.nodes()[node]["status"]
        return (int(status["capacity"].get(resource, 0)),
                int(status["allocatable"].get(resource, 0)))

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 120,
                 interval: float = 0.25) -> float:
        """Seconds until ``check()`` held; fails with ``what`` after ``timeout``."""
        start = time.monotonic()
        with steps.timed(f"{self.name}: wait for {what}"):
            while not check():
                assert time.monotonic() - start < timeout, f"timed out ({timeout:.0f}s): {what}"
                time.sleep(interval)
        return time.monotonic() - start

    def wait_resource(self, node: str, resource: str, want: tuple[int, int],
                      timeout: float = 120) -> float:
        got: list[tuple[int, int]] = []

        def check() -> bool:
            got.append(self.resource(node, resource))
            return got[-1] == want

        try:
            return self.wait_for(f"{node} {resource} (capacity, allocatable) = {want}",
                                 check, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen {got[-1] if got else None}") from None

    def run_pod(self, manifest: dict[str, Any], timeout: float = 120) -> str:
        """Create a pod that runs to completion; its logs."""
        name = manifest["metadata"]["name"]
        self.kubectl("apply", "-f", "-", input_text=json.dumps(manifest))

        def done() -> bool:
            phase = self.kubectl("get", "pod", name, "-o", "jsonpath={.status.phase}")
            assert phase != "Failed", self.kubectl("describe", "pod", name)
            return phase == "Succeeded"

        try:
            self.wait_for(f"pod {name} succeeded", done, timeout, interval=1)
        except AssertionError:
            print(self.kubectl("describe", "pod", name, check=False))
            raise
        return self.kubectl("logs", name)


def host_footprint() -> frozenset[str]:
    """Every mount on the host and every Docker volume, to compare before ``up`` and after
    ``down``: a bind mount can surface outside the state dir (at a node container's volume
    path), and a node's anonymous volumes outlive a container removed without ``-v``."""
    mounts = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True,
                            text=True, check=False).stdout.split()
    volumes = subprocess.run(["docker", "volume", "ls", "-q"], capture_output=True, text=True,
                             check=False).stdout.split()
    return frozenset([f"mount {m}" for m in mounts if not _beside(m)]
                     + [f"volume {v}" for v in volumes])


def _beside(mount: str) -> bool:
    """A mount of the test run beside this one: scripts/test runs the native e2e at the same
    time and lists in HWSANDBOX_TEST_BESIDE the path prefixes that run mounts below (its temp
    dirs and kubelet roots, which a kind sandbox never touches)."""
    prefixes = [p for p in os.environ.get("HWSANDBOX_TEST_BESIDE", "").split(":") if p]
    return any(mount.startswith(p) for p in prefixes)


def leftovers(name: str, before: frozenset[str] | None = None) -> list[str]:
    """Anything of sandbox ``name`` still here: containers, networks, mounts, state; with
    ``before`` (``host_footprint()`` taken before its ``up``), also any mount or Docker
    volume that was not there then."""
    found: list[str] = []
    if before is not None:
        found += sorted(host_footprint() - before)
    ps = subprocess.run(["docker", "ps", "-a", "--filter", f"label=io.x-k8s.kind.cluster={name}",
                         "--format", "{{.Names}}"], capture_output=True, text=True, check=False)
    found += [f"container {c}" for c in ps.stdout.split()]
    nets = subprocess.run(["docker", "network", "ls", "--format", "{{.Name}}"],
                          capture_output=True, text=True, check=False).stdout.split()
    found += [f"network {n}" for n in nets if n == f"hwsb-{name}"]
    mounts = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True,
                            check=False).stdout.split()
    found += [f"mount {m}" for m in mounts if m.startswith(str(STATE_ROOT / name))]
    if (STATE_ROOT / name).exists():
        found.append(f"state dir {STATE_ROOT / name}")
    return found


def up(kenv: KindEnv, profile: str, name: str, *extra: str) -> KindSandbox:
    """``sandbox up`` with the runtime left to choose (``--runtime auto``, the default): with
    Docker and kind here it must pick kind."""
    assert not leftovers(name), leftovers(name)
    before = host_footprint()
    start = time.monotonic()
    with steps.timed(f"{name}: sandbox up {profile} {' '.join(extra)}".rstrip()):
        proc = kenv.sandbox("up", str(REPO / "profiles" / profile), "--name", name, *extra,
                            check=False)
    took = time.monotonic() - start
    print(proc.stderr)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("runtime: kind; "), proc.stderr
    return KindSandbox(kenv, name, REPO / "profiles" / profile, took, before)


def down(sb: KindSandbox) -> None:
    if sb.state_dir.exists():  # else a test took it down already
        with steps.timed(f"{sb.name}: sandbox down"):
            sb.sandbox("down", "--name", sb.name)
    assert leftovers(sb.name, sb.before) == []


@contextlib.contextmanager
def _taken_down(kind_env: KindEnv) -> Iterator[Callable[..., KindSandbox]]:
    """``make(profile, name, *extra)`` brings sandboxes up; all of them are taken down (and
    checked) at the end."""
    made: list[KindSandbox] = []

    def make(profile: str, name: str, *extra: str) -> KindSandbox:
        # cleaned up at the end even when `up` itself fails (a --retain'ed or half-made one)
        made.append(KindSandbox(kind_env, name, REPO / "profiles" / profile, 0.0,
                                host_footprint()))
        made[-1] = up(kind_env, profile, name, *extra)
        return made[-1]

    yield make
    # newest first: each one's `before` was taken with the older ones up, so after its
    # down the host must look exactly as it did then; every one is taken down even when
    # an earlier one left something
    problems = []
    for sb in reversed(made):
        try:
            down(sb)
        except AssertionError as exc:
            problems.append(f"{sb.name}: {exc}")
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def sandbox_factory(kind_env: KindEnv) -> Iterator[Callable[..., KindSandbox]]:
    with _taken_down(kind_env) as make:
        yield make


DEMO_NAME = "hwsb-e2e-gpu"


@pytest.fixture(scope="session")
def demo_gpu(kind_env: KindEnv) -> Iterator[KindSandbox]:
    """profiles/8gpu-2numa.yaml with our plugin, one cluster for test_kind.py and then
    test_kind_author.py (each leaves it as it found it; test_kind_author.py's last test
    takes it down), instead of one each: a kind cluster's ``up`` and ``down`` are ~45 s
    of the run."""
    with _taken_down(kind_env) as make:
        yield make("8gpu-2numa.yaml", DEMO_NAME)


def node_state(state_root: Path, name: str, kubeconfig: Path,
               node: str = "gpu-worker") -> dict[str, Any]:
    """What ``node`` of sandbox ``name`` (its state dir under ``state_root``) is: every
    entry of its served tree (type, mode, a digest of what a read returns, a link's
    target, a device's numbers) and the node object's hwsandbox.dev labels."""
    root = state_root / name / "nodes" / node / "root"
    tree: dict[str, str] = {}
    for top in ("sys", "dev", "proc"):
        for dirpath, dirnames, filenames in os.walk(root / top):
            for entry in (*dirnames, *filenames):
                path = Path(dirpath) / entry
                st = path.lstat()
                rel = str(path.relative_to(root))
                if stat.S_ISLNK(st.st_mode):
                    tree[rel] = f"link {os.readlink(path)}"
                elif stat.S_ISREG(st.st_mode):
                    try:
                        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
                    except OSError as exc:
                        digest = f"errno {exc.errno}"
                    tree[rel] = f"file {oct(st.st_mode)} {digest}"
                elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                    tree[rel] = f"dev {oct(st.st_mode)} {os.major(st.st_rdev)}:" \
                                f"{os.minor(st.st_rdev)}"
                else:
                    tree[rel] = f"dir {oct(st.st_mode)}"
    nodes = json.loads(subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig), "get",
                                   "nodes", "-o", "json"], capture_output=True, text=True,
                                  check=True).stdout)["items"]
    labels = {k: v for n in nodes for k, v in n["metadata"]["labels"].items()
              if k.startswith("hwsandbox.dev/")
              and n["metadata"]["labels"].get("hwsandbox.dev/node") == node}
    assert tree, f"nothing served at {root}"
    assert labels, nodes
    return {"tree": tree, "labels": labels}


@dataclass
class Pristine:
    sandbox: KindSandbox
    state: dict[str, Any]  # node_state() of its gpu-worker right after its `up`


NO_PLUGIN_NAME = "hwsb-e2e-nvidia"


@pytest.fixture(scope="session")
def demo_no_plugin(kind_env: KindEnv) -> Iterator[Pristine]:
    """profiles/8gpu-2numa.yaml with --no-device-plugin, one cluster for two modules: its
    node's state right after `up` is test_workflow.py's reference (what a 3.11 `up` makes),
    then test_plugins.py runs NVIDIA's plugin and DRA driver on it and takes it down."""
    with _taken_down(kind_env) as make:
        sb = make("8gpu-2numa.yaml", NO_PLUGIN_NAME, "--no-device-plugin")
        yield Pristine(sb, node_state(STATE_ROOT, NO_PLUGIN_NAME, sb.kubeconfig))
