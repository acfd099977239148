"""The kind runtime end to end: real Docker, real kind v0.32.0, real Kubernetes v1.37.2.

Everything is built here from package registries only (no container registry): the node
image (``sandbox.images.node``: a Debian rootfs by mmdebstrap, kind's base files
from its Go module, our Go-built Kubernetes), the agent base image, kind itself. Missing
prerequisites FAIL with the command that fixes them; nothing is skipped.

Docker: the daemon ``DOCKER_HOST`` names (``scripts/test`` starts one with
``scripts/test-dockerd``), else the default socket. Run alone::

    scripts/build-k8s && scripts/build-containerd && eval "$(scripts/test-dockerd start)" &&
    sysctl -w fs.inotify.max_user_instances=1024 && tox -e kind-e2e

Every sandbox here lives in a private state root (``HWSANDBOX_STATE_DIR``), and every
``down`` is checked: no container, network, mount or state may remain.

Two pytest-xdist workers run side by side (tox.ini), each its own share of the modules
(``SHARES``): a run mostly waits on kind clusters, and with two at a time all of it took
9.2 min on a 2-core machine, against ~13 in one process. Both use one Docker daemon and
one host, so what one worker's sandbox leaves is told from what the other worker has up
at that moment (``new_since``)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from tests.support.gotools import cache_root, go_install  # noqa: E402

KIND_VERSION = "v0.32.0"
STATE_ROOT = Path("/run/hwsb-kind-e2e")
# one file per test that mounts outside its sandbox's state dir (the workflow's runner
# root), naming its sandbox and listing the paths below which the mounts are its own
CLAIMS = Path("/run/hwsb-kind-e2e-claims")
# the run's first worker takes down what an earlier run left; the others find its run id
# here (the file is also the lock they take turns on for that and the image builds)
RUN_LOCK = Path("/run/hwsb-kind-e2e.lock")
INOTIFY_INSTANCES = 512  # the least fs.inotify.max_user_instances a run asks for

# The two pytest-xdist workers' shares, each run in collection order by one worker
# (``pytest_xdist_make_scheduler``). Kept together: the modules that share a session
# cluster, in the order they need (test_kind.py then test_kind_author.py on demo_gpu;
# test_plugins.py then test_workflow.py after demo_no_plugin). Balanced by their times
# measured with both shares running (9.2 min for all): "a" ~500 s (failures 141, kind
# 130, kind_author 61, multinode 106, sriov 61), "b" ~485 s (plugins 274, topology 72,
# workflow 139). A module not named here is a share of its own, run by whichever worker
# is free.
SHARES = {"test_failures.py": "a", "test_kind.py": "a", "test_kind_author.py": "a",
          "test_multinode.py": "a", "test_sriov.py": "a", "test_plugins.py": "b",
          "test_topology.py": "b", "test_workflow.py": "b"}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scope scheduling with ``SHARES`` as the scopes (its own
    ``--dist loadgroup`` marks do not reach the scheduler under pytest 9.2: they are
    written to ``Item._nodeid``, which pytest 9 no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class Shares(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            return SHARES.get(module, module)

    return Shares(config, log)


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
def kind_env(request: pytest.FixtureRequest) -> KindEnv:
    if os.geteuid() != 0:
        pytest.fail("the kind tests run as root (they start containers and mount FUSE)")
    if shutil.which("docker") is None or not docker_ok():
        pytest.fail("no Docker daemon answers: start one with `eval \"$(scripts/test-dockerd "
                    "start)\"` (Debian: apt-get install docker.io)")
    bin_dir = cache_root() / "k8s" / "v1.37.2" / "bin"
    if not (bin_dir / "kubeadm").is_file() or not (bin_dir / "kubectl").is_file():
        pytest.fail(f"no kubeadm/kubectl in {bin_dir}: run scripts/build-k8s")
    # two workers' clusters side by side hold ~170 inotify instances (counted); past the
    # limit a kubelet cannot watch its static pods and kubeadm times out, saying nothing
    instances = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    if instances < INOTIFY_INSTANCES:
        pytest.fail(f"fs.inotify.max_user_instances is {instances}: two kind clusters at once "
                    f"need more (`sysctl -w fs.inotify.max_user_instances=1024`; scripts/test "
                    f"raises it for its run)")
    kind = go_install("sigs.k8s.io/kind", KIND_VERSION, "kind")
    from sandbox.errors import SandboxError
    from sandbox.images.agent import build_agent_base
    from sandbox.images.node import build_node_image

    with _run_lock():  # the other worker waits and then finds the images current
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
    # one id for all workers of a run (pytest-xdist's), a fresh one for a run without
    run = getattr(request.config, "workerinput", {}).get("testrunuid") or uuid.uuid4().hex
    with _run_lock() as lock:
        if lock.read().strip() != run:  # the run's first worker here
            _take_down_stale(kenv)
            lock.seek(0)
            lock.truncate()
            lock.write(run)
            lock.flush()
    return kenv


@contextlib.contextmanager
def _run_lock() -> Iterator[Any]:
    with open(os.open(RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o600), "r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield lock


def _take_down_stale(kenv: KindEnv) -> None:
    """An earlier run that was killed (or failed in a teardown) can have left sandboxes in
    this private state root: take them down as a user would, so that this run starts from
    nothing (up() still asserts that nothing of its name is left)."""
    for stale in sorted(STATE_ROOT.iterdir()) if STATE_ROOT.is_dir() else []:
        print(f"taking down sandbox {stale.name}, left by an earlier run")
        proc = kenv.sandbox("down", "--name", stale.name, check=False)
        if proc.returncode != 0:
            pytest.fail(f"sandbox {stale.name} is left from an earlier run and `sandbox down "
                        f"--name {stale.name}` failed:\n{proc.stderr}")
    shutil.rmtree(CLAIMS, ignore_errors=True)


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
        proc = subprocess.run(["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
                              input=input_text, text=True, capture_output=True, check=False,
                              env=self.kenv.env, timeout=timeout)
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


def new_since(before: frozenset[str], name: str, settle: float = 10) -> list[str]:
    """What ``host_footprint()`` has now that it did not have at ``before``, less what
    belongs to another sandbox (``_theirs``): the other worker's sandboxes come and go
    meanwhile. A mount or volume of the other's that went in the instant between the two
    looks is seen again ``settle`` seconds long; anything of ``name`` that stays is
    returned."""
    deadline = time.monotonic() + settle
    while True:
        now = host_footprint()
        mounts, volumes = _theirs(name)
        found = sorted(e for e in now - before
                       if not (e.startswith("mount ") and _below(e[6:], mounts)
                               or e.startswith("volume ") and e[7:] in volumes))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(1)


def _below(path: str, prefixes: set[str]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _theirs(name: str) -> tuple[set[str], set[str]]:
    """(mount prefixes, volume names) of everything up now that is not sandbox ``name``'s:
    other sandboxes' state dirs, the claims of other tests (``claim``), and the host
    mounts of every container but ``name``'s cluster (its root, its volumes, its network
    namespace, its /dev/shm): a build container or another kind cluster."""
    mounts = {str(d) for d in STATE_ROOT.iterdir() if d.name != name} \
        if STATE_ROOT.is_dir() else set()
    for f in CLAIMS.iterdir() if CLAIMS.is_dir() else []:
        if f.name != name:
            mounts.update(line for line in f.read_text().splitlines() if line)
    volumes: set[str] = set()
    ids = subprocess.run(["docker", "ps", "-aq"], capture_output=True, text=True,
                         check=False).stdout.split()
    inspected = subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True,
                               check=False).stdout if ids else "[]"
    for c in json.loads(inspected or "[]"):  # one gone meanwhile: inspect says so on stderr
        if (c["Config"].get("Labels") or {}).get("io.x-k8s.kind.cluster") == name:
            continue
        data = (c.get("GraphDriver") or {}).get("Data") or {}
        mounts.update(v for k, v in data.items() if k == "MergedDir")
        mounts.add(str(Path(c.get("ResolvConfPath") or "/nonexistent").parent))
        if (c.get("NetworkSettings") or {}).get("SandboxKey"):
            mounts.add(c["NetworkSettings"]["SandboxKey"])
        for m in c.get("Mounts") or []:
            if m.get("Type") == "volume":
                volumes.add(m["Name"])
                mounts.add(m["Source"])
    return mounts, volumes


@contextlib.contextmanager
def claim(name: str, *prefixes: Path) -> Iterator[None]:
    """Mounts below ``prefixes`` are sandbox ``name``'s while this lasts (the other
    worker's ``new_since`` looks here)."""
    CLAIMS.mkdir(mode=0o700, exist_ok=True)
    (CLAIMS / name).write_text("".join(f"{p}\n" for p in prefixes))
    try:
        yield
    finally:
        (CLAIMS / name).unlink()


def leftovers(name: str, before: frozenset[str] | None = None) -> list[str]:
    """Anything of sandbox ``name`` still here: containers, networks, mounts, state; with
    ``before`` (``host_footprint()`` taken before its ``up``), also any mount or Docker
    volume that was not there then (``new_since``)."""
    found: list[str] = []
    if before is not None:
        found += new_since(before, name)
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
    proc = kenv.sandbox("up", str(REPO / "profiles" / profile), "--name", name, *extra,
                        check=False)
    took = time.monotonic() - start
    print(proc.stderr)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("runtime: kind; "), proc.stderr
    return KindSandbox(kenv, name, REPO / "profiles" / profile, took, before)


def down(sb: KindSandbox) -> None:
    if sb.state_dir.exists():  # else a test took it down already
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
