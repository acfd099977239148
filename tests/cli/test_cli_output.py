"""Issue 26: `-o json|yaml` on the read verbs that had none (plugins list, dra slices,
kubelet check, fault run, fault list), the `dra` help a user reads, and one-line errors
that name the fix (non-root render --mknod and mount, a live mount, a state root too long
for a unix socket), through the installed console script on real servers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from sandbox.fakehw.devnodes import HARMLESS
from tests.support.cli import REPO, _env, build_wheel, sandbox, state_roots
from tests.support.fakehw_toy import require_fuse

pytestmark = [pytest.mark.root, pytest.mark.fuse, pytest.mark.network]

NODE = "net-worker"  # profiles/sriov-rdma.yaml


@pytest.fixture
def state_root() -> Iterator[Path]:
    yield from state_roots()


@pytest.fixture
def mounted() -> Iterator[tuple[Path, Path]]:
    """A `sandbox mount --daemon` server of 8gpu-2numa's node: (root, control socket)."""
    require_fuse()
    d = Path(tempfile.mkdtemp(prefix="hwso-", dir="/tmp"))
    out = sandbox("mount", "8gpu-2numa", str(d / "root"), "--node", "gpu-worker", "--daemon")
    assert out.returncode == 0, out.stderr
    try:
        yield d / "root", d / "root.sock"
    finally:
        subprocess.run(["fusermount3", "-u", str(d / "root")], check=False, capture_output=True)
        subprocess.run(["rm", "-rf", str(d)], check=False)


def test_plugins_list_as_data() -> None:
    table = sandbox("plugins", "list").stdout.splitlines()
    listed = json.loads(sandbox("plugins", "list", "-o", "json").stdout)
    assert [p["name"] for p in listed] == [line.split()[0] for line in table[1:]]
    assert set(listed[0]) == {"name", "kind", "suits", "shows"}
    assert yaml.safe_load(sandbox("plugins", "list", "-o", "yaml").stdout) == listed


def test_dra_slices_as_json() -> None:
    docs = list(yaml.safe_load_all(sandbox("dra", "slices", "mig-partitions").stdout))
    out = sandbox("dra", "slices", "mig-partitions", "-o", "json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == docs
    assert all(d["kind"] == "ResourceSlice" for d in docs)


def test_dra_help_is_for_users() -> None:
    out = sandbox("dra", "--help").stdout
    assert "sandbox dra slices PROFILE" in out
    assert "``" not in out, out  # no developer docstring
    assert "sandbox.dra" not in out, out
    health = sandbox("fault", "health", "--help").stdout
    assert "the device's id from the profile" in health, health


def test_fault_run_as_json(mounted: tuple[Path, Path], tmp_path: Path) -> None:
    _root, sock = mounted
    scenario = tmp_path / "s.yaml"
    scenario.write_text("version: 1\nsteps:\n"
                        "  - {at: 0, do: health, device: gpu1, health: unhealthy, "
                        "reason: aer-fatal}\n"
                        "  - {at: 0.1, expect: {gpu1: {health: unhealthy, plugged: true}}}\n"
                        "  - {at: 0.2, expect: {gpu2: {plugged: false}}}\n")
    out = sandbox("fault", "--socket", str(sock), "run", str(scenario), "-o", "json",
                  "--progress", "0")
    assert out.returncode == 1, out.stderr  # the last expectation does not hold
    data = json.loads(out.stdout)
    assert (data["ok"], data["applied"], data["met"]) == (False, 1, 1)
    first, second = data["expectations"]
    assert first["ok"] is True
    assert first["line"] == "steps[1] at 0.1s: gpu1 health unhealthy, plugged true: ok"
    assert second["ok"] is False
    assert second["expected"] == {"plugged": False}
    assert second["line"].startswith("steps[2] at 0.2s: gpu2 plugged false: FAILED, got "
                                     "health healthy, reason null, plugged true")
    text = sandbox("fault", "--socket", str(sock), "run", str(scenario), "--progress", "0")
    assert "{" not in text.stdout, text.stdout  # no Python reprs
    assert yaml.safe_load(sandbox("fault", "--socket", str(sock), "list", "-o",
                                  "yaml").stdout)["gpu-worker"]["gpu1"]["state"]["health"] \
        == "unhealthy"


def test_kubelet_check_as_json(mounted: tuple[Path, Path]) -> None:
    root, sock = mounted
    fault = f"{sys.executable} -m sandbox fault --socket {sock} health gpu-worker gpu2 " \
        "unhealthy --reason aer-fatal"
    out = sandbox("kubelet", "check", "-o", "json", "--restart-within", "2", "--fault", fault,
                  "--", sys.executable, "-m", "hwplugins.deviceplugin", "--root", str(root),
                  "--kubelet-dir", "{kubelet_dir}", "--interval", "0.2")
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert data["passed"] is True
    statuses = {c["name"]: c["status"] for c in data["checks"]}
    assert statuses["health-update"] == "pass", data["checks"]
    assert statuses["allocate"] == "pass"
    assert any(e["kind"] == "register" for e in data["events"]), data["events"][:5]


@pytest.fixture(scope="module")
def as_user() -> Iterator[Callable[..., subprocess.CompletedProcess[str]]]:
    """Run `sandbox ARGS` as the user nobody in a 0777 work dir. The test virtualenv may
    live below root's 0700 home, so the sandbox runs from an install nobody can read:
    Debian's python3 with the project's wheel and its dependencies (the patched pyfuse3
    from scripts/build-pyfuse3's cache) installed into a 0755 directory."""
    python = shutil.which("python3.11", path="/usr/bin")
    if python is None:
        pytest.fail("Debian's python3.11 is needed: apt-get install python3", pytrace=False)
    top = Path(tempfile.mkdtemp(prefix="hws-user-", dir="/tmp"))
    try:
        top.chmod(0o755)
        site, work = top / "site", top / "work"
        wheel = build_wheel(top / "build")
        cache = Path(os.environ.get("HWSANDBOX_CACHE") or
                     Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                     / "hw-sandbox")
        fuse = sorted(cache.glob("pyfuse3/*/pyfuse3-*-cp311-*.whl"))
        if not fuse:
            pytest.fail(f"no patched pyfuse3 wheel in {cache}: run scripts/build-pyfuse3",
                        pytrace=False)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", "--target", str(site),
                               str(fuse[-1]), str(wheel)], capture_output=True, text=True,
                              check=False, timeout=900)  # fmt: skip
        assert done.returncode == 0, done.stderr
        subprocess.run(["chmod", "-R", "a+rX", str(site)], check=True)
        work.mkdir()
        work.chmod(0o777)

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534",
                                   "--clear-groups", python, "-m", "sandbox", *args],
                                  cwd=work, text=True, capture_output=True, check=False,
                                  timeout=60, env={"PATH": "/usr/bin:/bin",
                                                   "PYTHONPATH": str(site)})  # fmt: skip

        ok = run("--version")
        assert ok.returncode == 0, f"user nobody cannot run the sandbox: {ok.stderr}"
        yield run
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=False)


def test_render_mknod_as_a_user_names_the_fix(
        as_user: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    out = as_user("render", "mig-single", "--out", "out", "--mknod")
    assert out.returncode == 1
    assert out.stderr == ("error: --mknod makes real device nodes, which needs root (sudo); "
                          "without --mknod they are empty placeholder files listed in "
                          "DIR/dev/.devices\n")
    assert as_user("render", "mig-single", "--out", "out").returncode == 0  # placeholders


def test_mount_as_a_user_names_the_fix(
        as_user: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    if os.access("/dev/fuse", os.R_OK | os.W_OK, effective_ids=False) and \
            os.stat("/dev/fuse").st_mode & 0o006 == 0o006:
        pytest.fail("/dev/fuse is open to every user here; this test needs it root-only "
                    "(the kernel's default mode, 0600)", pytrace=False)
    out = as_user("mount", "mig-single", "root", "--node", "mig-worker")
    assert out.returncode == 1
    assert out.stderr.startswith("error: "), out.stderr
    assert out.stderr.endswith("/root: cannot mount: /dev/fuse is not open to this user; run "
                               "as root (sudo), or where FUSE is available (modprobe fuse; a "
                               "container needs --device /dev/fuse)\n"), out.stderr


def test_a_live_mount_names_the_fix(mounted: tuple[Path, Path]) -> None:
    root, _sock = mounted
    again = sandbox("mount", "8gpu-2numa", str(root), "--node", "gpu-worker")
    assert again.returncode == 1
    assert again.stderr == (f"error: {root}: already mounted; unmount it with `fusermount3 "
                            f"-u {root}` (a sandbox's: `sandbox down --name NAME`)\n")


def test_a_state_root_too_long_for_a_socket_names_the_fix() -> None:
    require_fuse()
    long_root = Path(tempfile.mkdtemp(prefix="hws-" + "x" * 80, dir="/tmp"))
    try:
        env = _env(long_root)  # no kind on PATH: auto picks local, and says why in short
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                      if not (Path(p) / "kind").exists())
        out = sandbox("up", "8gpu-2numa", env=env)
        assert out.returncode == 1
        first = out.stderr.splitlines()[0]
        assert first == ("runtime: local; kind is not usable here: no kind on PATH "
                         "(`sandbox up --runtime kind` says what it needs)"), out.stderr
        [line] = [x for x in out.stderr.splitlines() if x.startswith("error:")]
        assert "(sun_path) holds at most 107 bytes" in line, line
        assert line.endswith(f"The fix: a shorter state root, e.g. HWSANDBOX_STATE_DIR=/tmp/hws "
                             f"(now {long_root}, {len(str(long_root))} bytes)"), line
        assert list(long_root.iterdir()) == []
    finally:
        subprocess.run(["rm", "-rf", str(long_root)], check=False)


def test_status_watch_and_exit_code(state_root: Path) -> None:
    """`status -o json --watch` prints a line when something changed (a fault), and
    `status` exits 1 once one of the sandbox's processes is gone (here: the plugin)."""
    require_fuse()
    env = _env(state_root)
    up = sandbox("up", "mig-single", "--runtime", "local", env=env)
    assert up.returncode == 0, up.stderr
    script = Path(sys.executable).parent / "sandbox"
    with subprocess.Popen([str(script), "status", "-o", "json", "--watch", "0.2"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as watch:
        try:
            assert watch.stdout is not None
            first = json.loads(watch.stdout.readline())
            assert first["nodes"][0]["down"] == []
            fault = sandbox("fault", "health", "mig-worker", "gpu1", "unhealthy", env=env)
            assert fault.returncode == 0, fault.stderr
            second = json.loads(watch.stdout.readline())  # printed because it changed
            health = {d["id"]: d["health"] for d in second["nodes"][0]["devices"]}
            assert health["gpu1"] == "unhealthy"
            watch.send_signal(signal.SIGINT)
            assert watch.wait(timeout=30) == 0
        finally:
            if watch.poll() is None:
                watch.kill()
    assert sandbox("status", env=env).returncode == 0
    record = json.loads((state_root / "mig-single" / "sandbox.json").read_text())
    plugin = int(record["nodes"]["mig-worker"]["procs"]["plugin"]["pid"])
    os.kill(plugin, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{plugin}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    status = sandbox("status", "-o", "json", env=env)
    assert status.returncode == 1, status.stdout
    assert json.loads(status.stdout)["nodes"][0]["down"] == ["plugin"]
    refused = sandbox("status", "--watch", "-o", "svg", env=env)
    assert refused.returncode == 1
    assert refused.stderr == "error: --watch prints tables or JSON lines, not pictures\n"


def test_mount_dev_dir_makes_stand_ins_and_takes_them_away(tmp_path: Path) -> None:
    """Issue 21 item 2 through the real server: `sandbox mount --dev-dir D` (what the kind
    agent runs) fills D with harmless root-only stand-ins, never the tree's 195:N or
    259:N, and the server removes them when it is unmounted."""
    require_fuse()
    d = Path(tempfile.mkdtemp(prefix="hwsdd-", dir="/tmp"))
    dev = d / "dev"
    dev.mkdir()
    try:
        out = sandbox("mount", "8gpu-2numa", str(d / "root"), "--node", "gpu-worker",
                      "--dev-dir", str(dev), "--daemon")
        assert out.returncode == 0, out.stderr
        made = {str(p.relative_to(dev)): p.lstat() for p in dev.rglob("*") if not p.is_dir()}
        assert {"nvidia0", "nvidia7", "nvidiactl", "nvme0", "nvme0n1"} <= set(made), made
        for name, st in made.items():
            assert stat.S_ISCHR(st.st_mode), name  # nvme0n1 is a block device in the tree
            assert (os.major(st.st_rdev), os.minor(st.st_rdev)) in HARMLESS, name
            assert stat.S_IMODE(st.st_mode) & ~0o660 == 0, (name, oct(st.st_mode))
            assert st.st_uid == 0, name
        seen = os.stat(d / "root" / "dev" / "nvidia3")  # the FUSE view keeps its numbers
        assert (os.major(seen.st_rdev), os.minor(seen.st_rdev)) == (195, 3)
        subprocess.run(["fusermount3", "-u", str(d / "root")], check=True)
        deadline = time.monotonic() + 20
        while any(dev.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(dev.iterdir()) == [], "the server leaves what it made in its dev dir"
    finally:
        subprocess.run(["fusermount3", "-u", str(d / "root")], check=False, capture_output=True)
        subprocess.run(["rm", "-rf", str(d)], check=False)


def test_validate_as_data(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "profiles" / "mig-single.yaml").read_text()
                   .replace("sockets: 2", "sockets: two", 1))
    out = sandbox("validate", "mig-single", str(bad), "-o", "json")
    assert out.returncode == 1
    good, wrong = json.loads(out.stdout)
    assert good == {"profile": "mig-single", "ok": True, "nodes": 1, "devices": 4,
                    "problems": []}
    assert wrong["ok"] is False
    [problem] = wrong["problems"]
    assert problem["file"] == str(bad)
    assert problem["path"] == "nodes[0].cpu.sockets"
    assert (problem["line"], problem["column"]) == (15, 16)
    assert yaml.safe_load(sandbox("validate", "mig-single", str(bad), "-o",
                                  "yaml").stdout) == [good, wrong]
    assert sandbox("validate", "mig-single", "-o", "json").returncode == 0


def test_fault_run_help_shows_the_format() -> None:
    out = sandbox("fault", "run", "--help").stdout
    assert "examples/health/scenario.yaml" in out
    assert "do: storm" in out
    assert "sandbox.fakehw" not in out
