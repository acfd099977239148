"""`sandbox up` with the local runtime, end to end through the CLI a user types."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.supervisor import start_time
from tests.support.fakehw_toy import require_fuse
from tests.support.paths import REPO as ROOT

pytestmark = [pytest.mark.root, pytest.mark.fuse]

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def state_root() -> Iterator[Path]:
    # gRPC unix socket paths must stay short (105 bytes): no pytest tmp_path here.
    d = Path(tempfile.mkdtemp(prefix="hws-", dir="/tmp"))
    try:
        yield d
    finally:
        for record in d.glob("*/sandbox.json"):  # a failed test must not leak a sandbox
            subprocess.run([sys.executable, "-m", "sandbox", "down", "--name",
                            record.parent.name], env=_env(d), capture_output=True, check=False)
        shutil.rmtree(d, ignore_errors=True)


def _env(state_root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["HWSANDBOX_STATE_DIR"] = str(state_root)
    env["PATH"] = os.pathsep.join(  # no kind on PATH: auto must pick local
        p for p in env["PATH"].split(os.pathsep) if not (Path(p) / "kind").exists())
    return env


def sandbox(state_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], cwd=ROOT, text=True,
                          capture_output=True, check=False, env=_env(state_root), timeout=120)


def _status(state_root: Path) -> dict[str, object]:
    result = sandbox(state_root, "status", "-o", "json")
    assert result.returncode == 0, result.stderr
    data: dict[str, object] = json.loads(result.stdout)
    return data


def _gpu_resource(status: dict[str, object]) -> dict[str, object]:
    nodes = status["nodes"]
    assert isinstance(nodes, list)
    [res] = [r for r in nodes[0]["resources"] if r["resource"] == "nvidia.com/gpu"]
    assert isinstance(res, dict)
    return res


def _wait_for(state_root: Path, capacity: int, allocatable: int) -> dict[str, object]:
    deadline = time.monotonic() + 10
    while True:
        res = _gpu_resource(_status(state_root))
        if (res["capacity"], res["allocatable"]) == (capacity, allocatable):
            return res
        assert time.monotonic() < deadline, f"still {res}"
        time.sleep(0.2)


def test_up_status_fault_down(state_root: Path) -> None:
    require_fuse()
    up = sandbox(state_root, "up", "profiles/8gpu-2numa.yaml")
    assert up.returncode == 0, up.stderr
    assert up.stderr.startswith("runtime: local; kind is not usable here: ")
    assert "is up (local runtime" in up.stdout

    table = sandbox(state_root, "status")
    assert table.returncode == 0, table.stderr
    assert "runtime: local" in table.stdout
    assert "nvidia.com/gpu  8         8            4              4" in table.stdout
    res = _gpu_resource(_status(state_root))
    assert res["by_numa"] == {"0": 4, "1": 4}

    fault = sandbox(state_root, "fault", "health", "gpu-worker", "gpu1", "unhealthy")
    assert fault.returncode == 0, fault.stderr
    _wait_for(state_root, capacity=8, allocatable=7)
    fault = sandbox(state_root, "fault", "unplug", "gpu-worker", "gpu6")
    assert fault.returncode == 0, fault.stderr
    res = _wait_for(state_root, capacity=7, allocatable=6)
    assert res["by_numa"] == {"0": 3, "1": 3}

    svg = sandbox(state_root, "status", "-o", "svg")
    assert svg.returncode == 0, svg.stderr
    picture = ET.fromstring(svg.stdout)
    for numa in ("0", "1"):
        group = picture.find(f".//{SVG}g[@class='numa'][@data-numa='{numa}']")
        assert group is not None
        gpus = group.findall(f".//{SVG}g[@data-kind='gpu']")
        assert len(gpus) == 4
    health = {g.get("data-device"): g.get("data-health")
              for g in picture.iter(f"{SVG}g") if g.get("data-device")}
    assert health["gpu1"] == "unhealthy"
    assert health["gpu6"] == "unplugged"

    restart = sandbox(state_root, "fault", "restart-kubelet", "gpu-worker")
    assert restart.returncode == 0, restart.stderr
    assert "gpu-worker: kubelet restarted" in restart.stdout
    # the plugin noticed the new kubelet.sock and registered again; the CLI waited for it
    assert "1 plugin registration(s) back after" in restart.stdout, restart.stdout
    assert "nvidia.com/gpu" in restart.stdout
    _wait_for(state_root, capacity=7, allocatable=6)

    record = json.loads((state_root / "8gpu-2numa" / "sandbox.json").read_text())
    pids = [int(p["pid"]) for p in record["nodes"]["gpu-worker"]["procs"].values()]
    root = Path(record["nodes"]["gpu-worker"]["root"])
    assert root.is_mount()

    down = sandbox(state_root, "down")
    assert down.returncode == 0, down.stderr
    assert not (state_root / "8gpu-2numa").exists()
    assert not root.is_mount()
    for pid in pids:  # gone, or an exited zombie until init reaps it (it is not our child)
        assert start_time(pid) is None, f"process {pid} still runs after down"
    with open("/proc/self/mountinfo") as f:
        assert str(state_root) not in f.read()


def test_dead_kubelet_is_reported_and_not_restarted(state_root: Path) -> None:
    require_fuse()
    assert sandbox(state_root, "up", "profiles/fpga-dfl.yaml").returncode == 0
    record = json.loads((state_root / "fpga-dfl" / "sandbox.json").read_text())
    [node] = record["nodes"]
    kubelet = int(record["nodes"][node]["procs"]["kubelet"]["pid"])
    os.kill(kubelet, signal.SIGKILL)
    for _ in range(200):
        if not Path(f"/proc/{kubelet}").exists():
            break
        time.sleep(0.05)
    status = sandbox(state_root, "status")
    assert status.returncode == 1  # NotReady is a failure for scripts
    assert "NotReady" in status.stdout
    assert "kubelet harness down" in status.stdout
    assert "no extended resources advertised" in status.stdout
    restart = sandbox(state_root, "fault", "restart-kubelet", node)
    assert restart.returncode == 1
    assert "is not running" in restart.stderr
    assert "Traceback" not in restart.stderr
    assert sandbox(state_root, "down").returncode == 0


def test_a_reused_pid_is_never_signalled(state_root: Path) -> None:
    """The kernel really hands the dead kubelet harness's pid to an unrelated process
    (ns_last_pid in a pid namespace of our own): status, restart-kubelet and down must
    tell it from ours by its start time and leave it alone."""
    require_fuse()
    if shutil.which("unshare") is None:
        pytest.fail("needs unshare (apt-get install util-linux)")
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount", "--mount-proc",
         sys.executable, str(ROOT / "tests" / "support" / "pid_reuse_probe.py")],
        cwd=ROOT, text=True, capture_output=True, check=False, env=_env(state_root),
        timeout=300)
    assert probe.returncode == 0, probe.stderr
    out = json.loads(probe.stdout.strip().splitlines()[-1])
    assert out["up"][0] == 0, out["up"]
    assert out["reused"], "could not hand the pid to another process"
    assert out["status"][0] == 1, out["status"]
    assert "not running" in out["status"][1], out["status"]
    assert out["restart"][0] == 1, out["restart"]
    assert "is not running" in out["restart"][1], out["restart"]
    assert out["down"][0] == 0, out["down"]
    assert out["stranger_alive"], "a process that merely reused a pid of ours was signalled"


def test_up_refuses_a_second_sandbox_of_the_same_name(state_root: Path) -> None:
    require_fuse()
    assert sandbox(state_root, "up", "profiles/fpga-dfl.yaml").returncode == 0
    again = sandbox(state_root, "up", "profiles/fpga-dfl.yaml")
    assert again.returncode == 1
    assert "already exists" in again.stderr
    assert sandbox(state_root, "down", "--name", "fpga-dfl").returncode == 0


def test_failed_up_cleans_up_and_names_the_step(state_root: Path) -> None:
    require_fuse()
    # A node name that resolves but whose mount point is refused: the mount step fails.
    # (What a crashed earlier `up` leaves: a marked state dir without a record.)
    (state_root / "8gpu-2numa").mkdir()
    (state_root / "8gpu-2numa" / ".hw-sandbox-state").write_text("")
    blocker = state_root / "8gpu-2numa" / "nodes" / "gpu-worker" / "root"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory")
    # A symlink inside the state dir to files it does not own: clean-up must not follow it.
    outside = state_root.parent / f"{state_root.name}-outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    (state_root / "8gpu-2numa" / "nodes" / "link").symlink_to(outside)
    up = sandbox(state_root, "up", "profiles/8gpu-2numa.yaml")
    assert up.returncode == 1
    assert "error: sandbox up failed at step 'mount gpu-worker'" in up.stderr
    assert "Traceback" not in up.stderr
    assert not (state_root / "8gpu-2numa" / "sandbox.json").exists()
    assert not (state_root / "8gpu-2numa").exists()
    assert (outside / "precious").read_text() == "keep me"
    shutil.rmtree(outside)


@pytest.mark.parametrize("name", ["..", ".", "../x", "a/b", "A", "-a", "a" * 64, "", "a\nb"])
def test_up_refuses_a_bad_sandbox_name_before_creating_anything(
        state_root: Path, name: str) -> None:
    # A state root one level down, so `..` would be state_root itself, with a file in it.
    inner = state_root / "run"
    (state_root / "precious").write_text("keep me")
    env_root = inner
    up = sandbox(env_root, "up", "profiles/8gpu-2numa.yaml", "--runtime", "local",
                 f"--name={name}")
    assert up.returncode == 1, up.stderr
    assert f"error: invalid sandbox name {name!r}" in up.stderr
    assert not inner.exists()
    assert (state_root / "precious").read_text() == "keep me"
    for verb in (["down"], ["status"]):
        result = sandbox(env_root, *verb, f"--name={name}")
        assert result.returncode == 1
        assert "invalid sandbox name" in result.stderr


def test_down_never_removes_a_directory_up_did_not_make(state_root: Path) -> None:
    # A record someone else wrote, in a directory without our marker.
    victim = state_root / "victim"
    victim.mkdir()
    (victim / "sandbox.json").write_text('{"runtime": "local", "nodes": {}}')
    (victim / "data").write_text("keep me")
    down = sandbox(state_root, "down", "--name", "victim")
    assert down.returncode == 1
    assert "no .hw-sandbox-state marker" in down.stderr
    assert (victim / "data").read_text() == "keep me"


def test_status_without_a_sandbox_is_a_clear_error(state_root: Path) -> None:
    result = sandbox(state_root, "status")
    assert result.returncode == 1
    assert result.stderr == "error: no sandbox is running; start one with `sandbox up PROFILE`\n"


def test_down_with_nothing_to_remove_says_so_and_succeeds(state_root: Path) -> None:
    """A CI teardown step runs `down` whatever happened before: no sandbox is not a failure."""
    for args, said in ((["down"], "no sandbox is running: nothing to remove"),
                       (["down", "--name", "ghost"], "no sandbox named 'ghost': nothing to remove"),
                       (["down", "--all"], "no sandbox is running: nothing to remove")):
        result = sandbox(state_root, *args)
        assert result.returncode == 0, result.stderr
        assert said in result.stderr
    invalid = sandbox(state_root, "down", "--name", "../x")
    assert invalid.returncode == 1
    assert "invalid sandbox name" in invalid.stderr


def test_down_all_removes_every_sandbox_and_a_second_down_succeeds(state_root: Path) -> None:
    require_fuse()
    for profile in ("fpga-dfl", "qat-vfio"):
        up = sandbox(state_root, "up", f"profiles/{profile}.yaml")
        assert up.returncode == 0, up.stderr
    ambiguous = sandbox(state_root, "down")
    assert ambiguous.returncode == 1
    assert "several sandboxes are running" in ambiguous.stderr
    down = sandbox(state_root, "down", "--all")
    assert down.returncode == 0, down.stderr
    assert "sandbox 'fpga-dfl' removed" in down.stdout
    assert "sandbox 'qat-vfio' removed" in down.stdout
    assert not list(state_root.glob("*/sandbox.json"))
    assert sandbox(state_root, "down").returncode == 0


def test_kubeconfig_of_a_local_sandbox_is_a_clear_error(state_root: Path) -> None:
    require_fuse()
    assert sandbox(state_root, "up", "profiles/fpga-dfl.yaml").returncode == 0
    result = sandbox(state_root, "kubeconfig")
    assert result.returncode == 1
    assert "runs the local runtime, which has no Kubernetes API server" in result.stderr
    assert "Traceback" not in result.stderr


def test_wait_for_allocatable_resources(state_root: Path) -> None:
    """`sandbox wait RESOURCE=N` returns once the kubelet advertises it, follows a fault,
    and times out naming what it saw."""
    require_fuse()
    assert sandbox(state_root, "up", "profiles/8gpu-2numa.yaml").returncode == 0
    waited = sandbox(state_root, "wait", "nvidia.com/gpu=8", "--timeout", "60")
    assert waited.returncode == 0, waited.stderr
    assert "allocatable nvidia.com/gpu=8" in waited.stderr
    assert sandbox(state_root, "fault", "unplug", "gpu-worker", "gpu3").returncode == 0
    after = sandbox(state_root, "wait", "nvidia.com/gpu=7", "--node", "gpu-worker",
                    "--timeout", "60")
    assert after.returncode == 0, after.stderr
    assert sandbox(state_root, "wait", "nvidia.com/gpu=1", "--at-least").returncode == 0
    late = sandbox(state_root, "wait", "nvidia.com/gpu=8", "--timeout", "1")
    assert late.returncode == 1
    assert "timed out after 1s waiting for nvidia.com/gpu=8 on sandbox 8gpu-2numa: " \
           "allocatable nvidia.com/gpu=7" in late.stderr, late.stderr
    bad = sandbox(state_root, "wait", "nvidia.com/gpu")
    assert bad.returncode == 2
    assert "expected RESOURCE=N" in bad.stderr
    nowhere = sandbox(state_root, "wait", "nvidia.com/gpu=1", "--node", "nope")
    assert nowhere.returncode == 1
    assert "has no node 'nope'" in nowhere.stderr
