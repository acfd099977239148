"""Issue 25: the example workflow users copy (.github/workflows/sandbox-example.yml), run as
GitHub's runner would run it, on a machine whose Python is not ours.

A Debian 13 (trixie) root (mmdebstrap; python3 3.13, externally managed, like ubuntu-24.04's
3.12) plays the runner. Every `run:` step executes there in order, as `bash -e` in the
workspace with the workflow's env, skipping the rest after a failure except `if: always()`
steps; the `uses:` steps are emulated: checkout is the workspace (tests/data/my-device-plugin,
a small Go device plugin standing in for the plugin under test), setup-go binds this
machine's Go toolchain and module cache, upload-artifact checks its files exist. What the
runner image has preinstalled comes from this machine: the docker CLI (talking to the test
Docker daemon), kubectl, sudo and git. The clone of hw-sandbox at its pinned tag is answered
from a local repository holding this checkout (git's url.insteadOf).

The root is entered with chroot in this machine's mount namespace. The Docker daemon sees
this machine's paths, so the sandbox's state root is bind-mounted into the root at the same
path (as it would simply be on a runner, where Docker is local), shared both ways.

Acceptance checked: install, `up --runtime kind`, the author's plugin advertising the GPUs,
a fault it reacts to, `kubelet check` passing with JUnit XML, teardown leaving nothing,
`down` rc 0 again; and the node state equal to what a 3.11 `up` of the same profile makes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sandbox.cache import cache_root
from tests.kind_e2e.conftest import KindEnv, Pristine, down, host_footprint, node_state
from tests.support.trixie import host_ca, need_root_tools, trixie_rootfs, unpack

pytestmark = [pytest.mark.root, pytest.mark.network]

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "sandbox-example.yml"
AUTHOR = REPO / "tests" / "data" / "my-device-plugin"
# the runner: what ubuntu-24.04 has that the workflow relies on (python3, sudo, git); the
# rest (python3-venv, gcc, libfuse3-dev, ...) is what scripts/install must bring itself
RUNNER_PACKAGES = ["python3", "sudo", "git", "ca-certificates", "mount", "util-linux"]
STATE = Path("/run/hwsb-wf")  # the runner's sandbox state root (same path in both views)
WORKSPACE = "/github/workspace"
CLONE_URL = "https://github.com/OWNER/hw-sandbox"
NAME = "8gpu-2numa"  # the workflow's `up` names it after the profile
NODE = "gpu-worker"
STEP_TIMEOUT = 1200


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=True, **kw)


class Runner:
    """The trixie root with its mounts (made in this mount namespace; all undone by
    ``close``, deepest first)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mounts: list[Path] = []

    def at(self, path: str | Path) -> Path:
        return self.root / str(path).lstrip("/")

    def bind(self, source: Path, target: str | Path, *, read_only: bool = False) -> None:
        dest = self.at(target)
        if source.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.touch()
        _run(["mount", "--bind", str(source), str(dest)])
        self.mounts.append(dest)
        if read_only:
            _run(["mount", "-o", "remount,bind,ro", str(dest)])

    def kernel_fs(self) -> None:
        """/proc, and a devpts of its own (apt and sudo want ptys)."""
        _run(["mount", "-t", "proc", "proc", str(self.at("/proc"))])
        self.mounts.append(self.at("/proc"))
        _run(["mount", "-t", "devpts", "-o", "newinstance,ptmxmode=0666", "devpts",
              str(self.at("/dev/pts"))])
        self.mounts.append(self.at("/dev/pts"))

    def close(self) -> list[str]:
        problems = []
        # Slaves first: an unmount in a shared peer group reaches every peer, and the binds
        # of shared trees (Docker's data root, its exec root) hold copies of what other
        # containers of that daemon mount there: unmounting the copies must leave the
        # originals alone (shown with a scratch peer group: `umount -R -l` of a copy took
        # the original with it; after `--make-rslave` it did not).
        for mount in self.mounts:
            subprocess.run(["mount", "--make-rslave", str(mount)], capture_output=True,
                           check=False)
        for mount in reversed(self.mounts):
            done = subprocess.run(["umount", "-R", "-l", str(mount)], capture_output=True,
                                  text=True, check=False)
            if done.returncode != 0:
                problems.append(f"umount {mount}: {done.stderr.strip()}")
        return problems


def _source_repo(dest: Path) -> None:
    """A git repository holding this checkout's tracked files as they are now, tagged as the
    workflow's pinned version (what `git clone --branch v0.1.0` fetches)."""
    files = _run(["git", "ls-files", "-z"], cwd=REPO).stdout.split("\0")
    dest.mkdir(parents=True)
    for name in filter(None, files):
        src = REPO / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the work tree
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dest / name)
        else:
            shutil.copy2(src, dest / name)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@invalid"]
    _run([*git, "init", "-q", "-b", "main"], cwd=dest)
    _run([*git, "add", "-A"], cwd=dest)
    _run([*git, "commit", "-q", "-m", "checkout"], cwd=dest)
    _run([*git, "tag", "v0.1.0"], cwd=dest)


def _go_env(name: str) -> Path:
    return Path(_run(["go", "env", name]).stdout.strip())


@contextlib.contextmanager
def shared_state_root() -> Iterator[Path]:
    """STATE as a shared mount of its own: the runner's bind of it joins its peer group, so
    what the runner mounts there (and the node containers' Bidirectional mounts) shows on
    both sides, as on one machine."""
    STATE.mkdir(mode=0o700, exist_ok=True)
    _run(["mount", "--bind", str(STATE), str(STATE)])
    try:
        _run(["mount", "--make-shared", str(STATE)])
        yield STATE
    finally:
        subprocess.run(["umount", "-R", "-l", str(STATE)], check=False)
        with contextlib.suppress(OSError):
            STATE.rmdir()


@contextlib.contextmanager
def runner_root(tmp: Path, kenv: KindEnv) -> Iterator[Runner]:
    need_root_tools()
    if shutil.which("go") is None:
        pytest.fail("the workflow builds its plugin with Go: install Go >= 1.24", pytrace=False)
    runner = Runner(tmp / "runner")
    unpack(trixie_rootfs(RUNNER_PACKAGES), runner.root)
    try:
        runner.bind(runner.root, "/")  # a root that is a mount, as every machine's is
        runner.kernel_fs()
        runner.bind(Path("/dev/fuse"), "/dev/fuse")
        runner.bind(STATE, STATE)
        docker_host = kenv.env.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        assert docker_host.startswith("unix://"), docker_host
        sock = Path(docker_host.removeprefix("unix://"))
        runner.bind(sock.parent, sock.parent)
        # Docker's data root, where kind's node volumes are: what the nodes mount there
        # shows on the runner, and `down` unmounts it (scripts/test-dockerd makes it shared)
        data_root = Path(_run(["docker", "info", "--format", "{{.DockerRootDir}}"],
                              env=kenv.env).stdout.strip())
        runner.bind(data_root, data_root)
        # preinstalled on GitHub's runner: the docker CLI and kubectl
        runner.bind(Path(shutil.which("docker") or "/usr/bin/docker"), "/usr/bin/docker",
                    read_only=True)
        runner.bind(kenv.bin_dir / "kubectl", "/usr/local/bin/kubectl", read_only=True)
        # actions/setup-go: this machine's toolchain, its module and build caches
        runner.bind(_go_env("GOROOT"), "/usr/local/go", read_only=True)
        runner.bind(_go_env("GOMODCACHE"), "/root/go/pkg/mod")
        runner.bind(_go_env("GOCACHE"), "/root/.cache/go-build")
        # caches kept between runs (a runner would use actions/cache): the packages apt
        # downloads, and the workflow's HWSANDBOX_CACHE (our pyfuse3 and NVML for 3.13)
        apt = cache_root() / "test" / "apt-trixie"
        apt.mkdir(parents=True, exist_ok=True)
        runner.bind(apt, "/var/cache/apt/archives")
        wf_cache = cache_root() / "test" / "workflow-cache"
        wf_cache.mkdir(parents=True, exist_ok=True)
        runner.bind(wf_cache, "/var/cache/hw-sandbox")
        # ... and the sandbox image's layers this machine's 3.11 built for the kind tests,
        # as a restored cache: keyed by the image's Python, they are the 3.13 runner's too
        for layers in ("kind", "agent-image"):
            runner.bind(cache_root() / layers, f"/var/cache/hw-sandbox/{layers}")
        # this machine's network: its resolver, hosts and the CAs it trusts (a proxy's)
        for name in ("/etc/resolv.conf", "/etc/hosts"):
            shutil.copyfile(name, runner.at(name), follow_symlinks=True)
        ca = host_ca()
        if ca is not None:
            shutil.copyfile(ca, runner.at("/etc/ssl/certs/ca-certificates.crt"))
        _source_repo(runner.at("/srv/hw-sandbox"))
        _run(["chroot", str(runner.root), "git", "config", "--system",
              "url.file:///srv/hw-sandbox.insteadOf", CLONE_URL])
        shutil.copytree(AUTHOR, runner.at(WORKSPACE), ignore=shutil.ignore_patterns("bin"))
        runner.at("/runner-temp").mkdir()
        yield runner
    finally:
        problems = runner.close()
        assert not problems, problems


def _step_env(runner: Runner, workflow: dict[str, Any], job: dict[str, Any],
              kenv: KindEnv) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/go/bin:/root/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:"
                "/usr/bin:/sbin:/bin",
        "HOME": "/root", "USER": "root", "LANG": "C.UTF-8", "CI": "true",
        "GITHUB_WORKSPACE": WORKSPACE, "RUNNER_TEMP": "/runner-temp",
        "DOCKER_HOST": kenv.env.get("DOCKER_HOST", "unix:///var/run/docker.sock"),
        # not in the workflow: where this test keeps the runner's sandboxes (see STATE)
        "HWSANDBOX_STATE_DIR": str(STATE),
        # the test plugin's image is FROM scratch: a static binary
        "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOFLAGS": "-p=2",
    }
    for name in ("GOPROXY", "GONOSUMDB", "GOSUMDB", "GOPRIVATE", "PIP_INDEX_URL"):
        if name in os.environ:
            env[name] = os.environ[name]
    if host_ca() is not None:
        env["PIP_CERT"] = "/etc/ssl/certs/ca-certificates.crt"
    env.update({k: str(v) for k, v in (workflow.get("env") or {}).items()})
    env.update({k: str(v) for k, v in (job.get("env") or {}).items()})
    return env


def _emulate_uses(step: dict[str, Any], runner: Runner, artifacts: list[str]) -> None:
    action = step["uses"].split("@")[0]
    if action == "actions/checkout":
        assert runner.at(WORKSPACE).is_dir()
    elif action == "actions/setup-go":
        assert runner.at("/usr/local/go/bin/go").is_file()
    elif action == "actions/upload-artifact":
        artifacts += str(step["with"]["path"]).split()
    else:
        pytest.fail(f"the workflow uses {step['uses']}, which this test cannot emulate")


def _diff(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return [f"{k}: {a.get(k)} != {b.get(k)}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]


def _wait(what: str, check: Callable[[], bool], timeout: float) -> None:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"timed out ({timeout:.0f} s): {what}"
        time.sleep(1)


def test_example_workflow_from_a_trixie_runner(demo_no_plugin: Pristine, kind_env: KindEnv,
                                               tmp_path: Path) -> None:
    """Issue 25's acceptance: the workflow's steps pass on a Python 3.13 runner, and its
    sandbox's node is the one a 3.11 `up` of the same profile makes."""
    # the 3.11 reference: this machine's python, the same profile, no plugin of ours (the
    # node as it was right after that `up`; test_plugins.py has used it since, and taken
    # it down)
    reference = demo_no_plugin.state
    if demo_no_plugin.sandbox.state_dir.exists():
        down(demo_no_plugin.sandbox)

    workflow = yaml.safe_load(WORKFLOW.read_text())
    (job,) = workflow["jobs"].values()
    before = host_footprint()
    log: list[str] = []
    outputs: dict[str, str] = {}
    artifacts: list[str] = []
    with shared_state_root(), runner_root(tmp_path, kind_env) as runner:
        env = _step_env(runner, workflow, job, kind_env)
        failed: str | None = None
        state: dict[str, Any] | None = None
        try:
            for i, step in enumerate(job["steps"]):
                label = step.get("name", step.get("uses", f"step {i}"))
                if failed and "always()" not in str(step.get("if", "")):
                    log.append(f"== {label}: skipped (an earlier step failed)")
                    continue
                if "uses" in step:
                    _emulate_uses(step, runner, artifacts)
                    continue
                script = runner.at(f"/wf/{i:02d}.sh")
                script.parent.mkdir(exist_ok=True)
                script.write_text(step["run"])
                start = time.monotonic()
                done = subprocess.run(
                    ["chroot", str(runner.root), "/bin/sh", "-c", 'cd "$0" && exec bash -e "$1"',
                     WORKSPACE, f"/wf/{i:02d}.sh"],
                    env=env, capture_output=True, text=True, check=False,
                    stdin=subprocess.DEVNULL, timeout=STEP_TIMEOUT)
                outputs[label] = done.stdout + done.stderr
                log.append(f"== {label}: rc {done.returncode} in {time.monotonic() - start:.0f}"
                           f" s\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
                if done.returncode != 0 and not failed:
                    failed = label
                if label.startswith("Wait until the kubelet") and done.returncode == 0:
                    state = node_state(STATE, NAME, STATE / NAME / "kubeconfig")
            print("\n".join(log))
            assert failed is None, f"step {failed!r} failed:\n" + "\n".join(log[-3:])

            # the image cache is keyed by the image's Python: the 3.13 runner's `up` (an
            # installed sandbox) found the layers this machine's 3.11 (a checkout) built
            (up_step,) = [s["name"] for s in job["steps"] if "sandbox up" in s.get("run", "")]
            assert "deps: installing" not in outputs[up_step], outputs[up_step]
            assert "mmdebstrap" not in outputs[up_step], outputs[up_step]

            # the artifacts, and the kubelet check's JUnit report: every check passed
            for path in artifacts:
                assert runner.at(WORKSPACE).joinpath(path).is_file(), path
            report = ET.parse(runner.at(WORKSPACE) / "kubelet-check.xml").getroot()
            suite = report if report.tag == "testsuite" else report.find("testsuite")
            assert suite is not None, ET.tostring(report).decode()
            shown = ET.tostring(suite).decode()
            assert int(suite.get("tests", 0)) >= 5, shown
            assert suite.get("failures") == "0", shown
            assert suite.get("errors", "0") == "0", shown

            # `down` again: nothing to remove, rc 0
            again = subprocess.run(["chroot", str(runner.root), "sandbox", "down"], env=env,
                                   capture_output=True, text=True, check=False)
            assert again.returncode == 0, again.stderr
        finally:
            # whatever happened, nothing of the runner's sandbox may stay up
            if (STATE / NAME).exists():
                subprocess.run(["chroot", str(runner.root), "sandbox", "down", "--all"],
                               env=env, capture_output=True, check=False, timeout=600)
    # same node as from 3.11: the served tree and the node's labels
    assert state is not None
    print(f"node state compared: {len(state['tree'])} tree entries, "
          f"labels {sorted(state['labels'])}")
    assert _diff(reference["labels"], state["labels"]) == []
    assert _diff(reference["tree"], state["tree"]) == []
    # nothing left: containers, network, mounts, state
    ps = _run(["docker", "ps", "-a", "--filter", f"label=io.x-k8s.kind.cluster={NAME}",
               "--format", "{{.Names}}"], env=kind_env.env).stdout.split()
    assert ps == []
    assert sorted(host_footprint() - before) == []
    assert not STATE.exists()
