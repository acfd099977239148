"""oci-cpumap installed (sandbox.runtimes.cpumap.install), shipped, and in front of this
machine's real runc: the wrapper's behaviour against a fake runc is in test_oci_cpumap.py,
whose fake runc, bundle writer and tool checks these tests share.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tomllib
import uuid
from pathlib import Path

import pytest

from sandbox.errors import SandboxError
from sandbox.runtimes import cpumap
from sandbox.runtimes.cpumap import map_cpulist
from tests.runtimes.test_oci_cpumap import FAKE_RUNC, HINT, need
from tests.support.paths import REPO as ROOT

pytestmark = [pytest.mark.root]


# --- install ------------------------------------------------------------------------------

def test_install_writes_an_executable_script(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        dest = cpumap.install(tmp_path / "a" / "b" / "oci-cpumap", "/usr/sbin/runc")
    finally:
        os.umask(old)
    assert dest == tmp_path / "a" / "b" / "oci-cpumap"
    for path, mode in [(dest, 0o755), (dest.parent, 0o755), (dest.parent.parent, 0o755)]:
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    assert dest.stat().st_uid == os.getuid()
    assert dest.read_text() == cpumap.script_text("/usr/sbin/runc")
    assert "REAL_RUNC=/usr/sbin/runc\n" in dest.read_text().splitlines(keepends=True)
    inode = dest.stat().st_ino
    cpumap.install(dest, "/usr/bin/runc")
    assert dest.stat().st_ino != inode  # replaced by rename, never written in place
    assert os.listdir(dest.parent) == ["oci-cpumap"]


def test_install_quotes_the_real_runc(tmp_path: Path) -> None:
    need("jq")
    real = tmp_path / "it's a $dir `x`" / "runc"
    real.parent.mkdir()
    real.write_text(FAKE_RUNC)
    real.chmod(0o755)
    dest = cpumap.install(tmp_path / "oci-cpumap", str(real))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([str(dest), "--version"], capture_output=True, check=False,
                          env={**os.environ, "FAKE_RUNC_OUT": str(out)}, stdin=subprocess.DEVNULL)
    assert (proc.returncode, proc.stdout) == (0, b"fake-runc-stdout\n")
    assert (out / "argv").read_bytes() == b"--version\0"


@pytest.mark.parametrize("real", ["runc", "./runc", "", "/usr/bin/runc\nrm -rf /", "/a\x00b"])
def test_install_refuses_a_bad_real_runc(tmp_path: Path, real: str) -> None:
    with pytest.raises(SandboxError, match="the real runc must be an absolute path"):
        cpumap.install(tmp_path / "oci-cpumap", real)
    assert not (tmp_path / "oci-cpumap").exists()


def test_the_uninstalled_template_refuses_to_run() -> None:
    proc = subprocess.run(["sh", str(cpumap.SCRIPT), "--version"], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 1
    assert proc.stderr == ("oci-cpumap: no real runc set: install this script with "
                           "sandbox.runtimes.cpumap.install()\n")


def test_the_script_is_shipped_as_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "runtimes/oci-cpumap" in config["package-data"]["sandbox"]


def test_shellcheck_is_clean() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck is not installed: apt-get install -y shellcheck")
    proc = subprocess.run([shellcheck, "-s", "sh", str(cpumap.SCRIPT)], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stdout


# --- the real runc ------------------------------------------------------------------------

def real_runc() -> str:
    path = shutil.which("runc")
    if path is None:
        pytest.fail(f"runc is not installed: {HINT}")
    return path


def test_real_runc_version_is_unchanged(tmp_path: Path) -> None:
    need("jq")
    runc = real_runc()
    dest = cpumap.install(tmp_path / "oci-cpumap", runc)
    direct = subprocess.run([runc, "--version"], capture_output=True, check=False)
    wrapped = subprocess.run([str(dest), "--version"], capture_output=True, check=False)
    assert direct.returncode == 0, direct.stderr
    assert (wrapped.returncode, wrapped.stdout, wrapped.stderr) == (0, direct.stdout,
                                                                    direct.stderr)


def real_bundle(runc: str, b: Path, tool: str) -> Path:
    """An OCI bundle at ``b`` for the real runc: ``runc spec``'s config and a rootfs holding
    this machine's ``tool`` at ``/<tool>`` with the libraries it links."""
    rootfs = b / "rootfs"
    rootfs.mkdir(parents=True)
    binary = Path(shutil.which(tool) or f"/bin/{tool}").resolve()
    shutil.copy2(binary, rootfs / tool)
    libs = subprocess.run(["ldd", str(binary)], capture_output=True, text=True,
                          check=True).stdout
    for lib in {w for w in libs.split() if w.startswith("/")}:
        target = rootfs / lib.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, target)
    subprocess.run([runc, "spec"], cwd=b, check=True)
    return b


def run_once(runtime: Path, runc: str, b: Path, state: Path,
             prefix: str) -> subprocess.CompletedProcess[str]:
    """``runtime run`` of bundle ``b`` as a container named ``<prefix>-<pid>-<random>``,
    deleted with the real ``runc`` after, whatever happened."""
    name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        return subprocess.run([str(runtime), "--root", str(state), "run", "--bundle", str(b),
                               name], capture_output=True, text=True, timeout=60, check=False,
                              stdin=subprocess.DEVNULL)
    finally:
        subprocess.run([runc, "--root", str(state), "delete", "-f", name], capture_output=True,
                       check=False)


def first_line(*paths: str) -> str:
    for path in paths:
        try:
            line = Path(path).read_text().strip()
        except OSError:
            continue
        if line:
            return line
    raise AssertionError(f"none of {paths} is readable")


def last_id(cpulist: str) -> int:
    return max(int(part.rpartition("-")[2]) for part in cpulist.split(","))


def test_real_runc_runs_a_container_with_emulated_cpusets(tmp_path: Path) -> None:
    need("jq")
    runc = real_runc()
    if os.geteuid() != 0 or not Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists():
        pytest.fail("this test starts a real container: it needs root and a cgroup v1 cpuset "
                    "hierarchy at /sys/fs/cgroup/cpuset")
    allowed_cpus = first_line("/sys/fs/cgroup/cpuset/cpuset.effective_cpus",
                              "/sys/fs/cgroup/cpuset/cpuset.cpus")
    allowed_mems = first_line("/sys/fs/cgroup/cpuset/cpuset.effective_mems",
                              "/sys/fs/cgroup/cpuset/cpuset.mems")
    # Ids past the host's, as the kubelet asks for them on an emulated 64-CPU, 2-node machine.
    cpus = f"0-{max(63, last_id(allowed_cpus) + 1)}"
    mems = str(max(1, last_id(allowed_mems) + 1))

    b = real_bundle(runc, tmp_path / "bundle", "cat")
    spec = json.loads((b / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = ["/cat", "/proc/self/status"]
    spec["linux"].setdefault("resources", {})["cpu"] = {"cpus": cpus, "mems": mems}
    (b / "config.json").write_text(json.dumps(spec))

    state = tmp_path / "state"
    wrapped = cpumap.install(tmp_path / "oci-cpumap", runc)
    plain_id, wrapped_id = (f"hwsb-cpumap-{os.getpid()}-{uuid.uuid4().hex[:8]}-{n}"
                            for n in ("plain", "wrapped"))
    try:
        plain = subprocess.run([runc, "--root", str(state), "run", "--bundle", str(b), plain_id],
                               capture_output=True, text=True, timeout=60, check=False,
                               stdin=subprocess.DEVNULL)
        assert plain.returncode != 0
        assert "cpuset.cpus: numerical result out of range" in plain.stderr, plain.stderr

        spec["linux"]["resources"]["cpu"] = {"cpus": "0", "mems": mems}
        (b / "config.json").write_text(json.dumps(spec))
        plain = subprocess.run([runc, "--root", str(state), "run", "--bundle", str(b), plain_id],
                               capture_output=True, text=True, timeout=60, check=False,
                               stdin=subprocess.DEVNULL)
        assert plain.returncode != 0
        assert "cpuset.mems: invalid argument" in plain.stderr, plain.stderr

        spec["linux"]["resources"]["cpu"] = {"cpus": cpus, "mems": mems}
        (b / "config.json").write_text(json.dumps(spec))
        proc = subprocess.run([str(wrapped), "--root", str(state), "run", "--bundle", str(b),
                               wrapped_id], capture_output=True, text=True, timeout=60,
                              check=False, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr
    finally:
        for container in (plain_id, wrapped_id):
            subprocess.run([runc, "--root", str(state), "delete", "-f", container],
                           capture_output=True, check=False)
    status = dict(line.split(":\t", 1) for line in proc.stdout.splitlines() if ":\t" in line)
    assert status["Cpus_allowed_list"] == map_cpulist(cpus, allowed_cpus)
    assert status["Mems_allowed_list"] == map_cpulist(mems, allowed_mems)
    doc = json.loads((b / "config.json").read_text())
    assert doc["linux"]["resources"]["cpu"] == {"cpus": map_cpulist(cpus, allowed_cpus),
                                                "mems": map_cpulist(mems, allowed_mems)}
    assert doc["annotations"] == {"hwsandbox.dev/emulated-cpus": cpus,
                                  "hwsandbox.dev/emulated-mems": mems}
