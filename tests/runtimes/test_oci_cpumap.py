"""oci-cpumap (sandbox/runtimes/oci-cpumap), driven the way go-runc drives runc.

The wrapper is installed into tmp_path in front of a fake runc (an outside boundary: a script
that records its argv, cwd, pid, stdin and the config.json it is handed, then exits with a
chosen code), and at the end in front of this machine's real runc. Allowed sets come from the
wrapper's test-only HWSB_CPUMAP_CPUS_FILE / HWSB_CPUMAP_MEMS_FILE; expected values from
``cpumap.map_cpulist``, the same rule in Python.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandbox.runtimes import cpumap
from sandbox.runtimes.cpumap import map_cpulist

pytestmark = [pytest.mark.root]

HINT = "run scripts/install-system-deps"

FAKE_RUNC = r"""#!/bin/sh
out=$FAKE_RUNC_OUT
echo $$ >"$out/pid"
pwd >"$out/cwd"
for arg; do printf '%s\0' "$arg"; done >"$out/argv"
cat >"$out/stdin"
if [ -n "${FAKE_RUNC_CONFIG:-}" ] && [ -f "$FAKE_RUNC_CONFIG" ]; then
    cp "$FAKE_RUNC_CONFIG" "$out/config.json"
fi
echo fake-runc-stdout
echo fake-runc-stderr >&2
exit "${FAKE_RUNC_EXIT:-0}"
"""


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: {HINT} (or apt-get install -y {tool})")
    return path


@dataclass
class Call:
    returncode: int
    stdout: bytes
    stderr: str
    wrapper_pid: int
    out: Path

    @property
    def ran(self) -> bool:
        return (self.out / "argv").exists()

    @property
    def argv(self) -> list[str]:
        return (self.out / "argv").read_bytes().decode().split("\0")[:-1]

    @property
    def runc_pid(self) -> int:
        return int((self.out / "pid").read_text())

    @property
    def cwd(self) -> Path:
        return Path((self.out / "cwd").read_text().strip())

    @property
    def stdin(self) -> bytes:
        return (self.out / "stdin").read_bytes()

    @property
    def config(self) -> dict[str, object]:
        doc: dict[str, object] = json.loads((self.out / "config.json").read_text())
        return doc


@dataclass
class Wrapper:
    path: Path
    tmp: Path
    allowed_cpus: Path
    allowed_mems: Path

    def allow(self, cpus: str, mems: str) -> None:
        self.allowed_cpus.write_text(cpus + "\n")
        self.allowed_mems.write_text(mems + "\n")

    def run(self, args: list[str], *, stdin: bytes = b"", cwd: Path | None = None,
            exit_code: int = 0, config: Path | str | None = None,
            env: dict[str, str] | None = None) -> Call:
        out = Path(self.tmp / f"call-{uuid.uuid4().hex[:8]}")
        out.mkdir()
        environ = {
            **os.environ,
            "HWSB_CPUMAP_CPUS_FILE": str(self.allowed_cpus),
            "HWSB_CPUMAP_MEMS_FILE": str(self.allowed_mems),
            "FAKE_RUNC_OUT": str(out),
            "FAKE_RUNC_EXIT": str(exit_code),
            "FAKE_RUNC_CONFIG": str(config or ""),
            **(env or {}),
        }
        proc = subprocess.Popen([str(self.path), *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                env=environ)
        stdout, stderr = proc.communicate(stdin, timeout=20)
        return Call(proc.returncode, stdout, stderr.decode(), proc.pid, out)


@pytest.fixture
def wrapper(tmp_path: Path) -> Wrapper:
    need("jq")
    fake = tmp_path / "fake-runc"
    fake.write_text(FAKE_RUNC)
    fake.chmod(0o755)
    w = Wrapper(cpumap.install(tmp_path / "bin" / "oci-cpumap", str(fake)), tmp_path,
                tmp_path / "allowed-cpus", tmp_path / "allowed-mems")
    w.allow("0-1", "0")
    return w


def go_runc_globals(tmp_path: Path) -> list[str]:
    return ["--root", str(tmp_path / "state"), "--log", str(tmp_path / "log.json"),
            "--log-format", "json", "--systemd-cgroup"]


def bundle(tmp_path: Path, cpu: dict[str, object] | None, name: str = "bundle") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    doc: dict[str, object] = {
        "ociVersion": "1.0.2-dev",
        "process": {"args": ["/pause"], "cwd": "/"},
        "annotations": {"io.kubernetes.cri.container-type": "container"},
        "linux": {"resources": {"memory": {"limit": 1073741824}}},
    }
    if cpu is not None:
        doc["linux"] = {"resources": {"memory": {"limit": 1073741824}, "cpu": cpu}}
    (directory / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
    return directory


def cpu_of(doc: dict[str, object]) -> dict[str, object]:
    linux = doc["linux"]
    assert isinstance(linux, dict)
    cpu: dict[str, object] = linux["resources"]["cpu"]
    return cpu


# --- the rule -----------------------------------------------------------------------------

@pytest.mark.parametrize(("ids", "allowed", "expected"), [
    ("1-31,33-63", "0-1", "0-1"),
    ("5", "0-1", "1"),
    ("1", "0", "0"),
    ("0-1", "0-1", "0-1"),
    ("1,0", "0-1", "1,0"),
    ("", "0-1", ""),
    ("1-31,33-63", "0,2-3", "0,2-3"),
    ("4", "0,2-3", "2"),
    ("5,7", "0,2-3", "2-3"),
    ("0,3", "0,2-3", "0,3"),
    ("8-9", "0-3,8-11", "8-9"),
    ("12", "0-3,8-11", "8"),
])
def test_map_cpulist(ids: str, allowed: str, expected: str) -> None:
    assert map_cpulist(ids, allowed) == expected


# --- create and run -----------------------------------------------------------------------

@pytest.mark.parametrize("form", ["--bundle X", "--bundle=X", "-b X", "cwd"])
def test_create_rewrites_the_bundle_config(wrapper: Wrapper, tmp_path: Path, form: str) -> None:
    b = bundle(tmp_path, {"cpus": "1-31,33-63", "mems": "1", "shares": 2})
    flag = {"--bundle X": ["--bundle", str(b)], "--bundle=X": [f"--bundle={b}"],
            "-b X": ["-b", str(b)], "cwd": []}[form]
    args = [*go_runc_globals(tmp_path), "create", *flag, "--pid-file", str(tmp_path / "pid"),
            "ctr-1"]
    call = wrapper.run(args, cwd=b if form == "cwd" else tmp_path, config=b / "config.json")
    assert (call.returncode, call.stderr) == (0, "fake-runc-stderr\n")
    assert call.stdout == b"fake-runc-stdout\n"
    assert call.argv == args
    assert call.runc_pid == call.wrapper_pid  # exec'd, not a child
    assert cpu_of(call.config) == {"cpus": "0-1", "mems": "0", "shares": 2}
    assert call.config["annotations"] == {
        "io.kubernetes.cri.container-type": "container",
        "hwsandbox.dev/emulated-cpus": "1-31,33-63",
        "hwsandbox.dev/emulated-mems": "1",
    }
    assert sorted(p.name for p in b.iterdir()) == ["config.json"]  # no temp file left


def test_run_is_handled_like_create(wrapper: Wrapper, tmp_path: Path) -> None:
    b = bundle(tmp_path, {"cpus": "5", "mems": "1"})
    args = [*go_runc_globals(tmp_path), "run", "--bundle", str(b), "-d", "--pid-file",
            str(tmp_path / "pid"), "--console-socket", str(tmp_path / "sock"), "ctr-1"]
    call = wrapper.run(args, config=b / "config.json", exit_code=4)
    assert call.returncode == 4
    assert call.argv == args
    assert cpu_of(call.config) == {"cpus": "1", "mems": "0"}


@pytest.mark.parametrize(
    ("cpus", "mems", "allowed_cpus", "allowed_mems", "want_cpus", "want_mems"), [
    ("1-31,33-63", "1", "0-1", "0", "0-1", "0"),
    ("5", "0-1", "0-1", "0", "1", "0"),
    ("1-31,33-63", "1", "0,2-3", "0-1", "0,2-3", "1"),
    ("4", "3", "0,2-3", "0-1", "2", "1"),
    ("0-1", "1", "0-1", "0", "0-1", "0"),  # only mems need mapping
    ("63", "0", "0-1", "0", "1", "0"),  # only cpus need mapping
    ("", "1", "0-1", "0", "", "0"),  # an empty list stays empty
    ])
def test_mapping_follows_the_rule(wrapper: Wrapper, tmp_path: Path, cpus: str, mems: str,
                                  allowed_cpus: str, allowed_mems: str, want_cpus: str,
                                  want_mems: str) -> None:
    wrapper.allow(allowed_cpus, allowed_mems)
    b = bundle(tmp_path, {"cpus": cpus, "mems": mems})
    call = wrapper.run(["create", "--bundle", str(b), "c"], config=b / "config.json")
    assert call.returncode == 0, call.stderr
    assert cpu_of(call.config) == {"cpus": want_cpus, "mems": want_mems}
    assert (map_cpulist(cpus, allowed_cpus), map_cpulist(mems, allowed_mems)) == (want_cpus,
                                                                                 want_mems)
    annotations = call.config["annotations"]
    assert isinstance(annotations, dict)
    emulated = {k: v for k, v in annotations.items() if k.startswith("hwsandbox.dev/")}
    assert emulated == {f"hwsandbox.dev/emulated-{key}": old
                        for key, old, new in [("cpus", cpus, want_cpus), ("mems", mems, want_mems)]
                        if old != new}


def test_random_lists_map_like_the_oracle(wrapper: Wrapper) -> None:
    rng = random.Random(20240611)
    for _ in range(25):
        allowed = ",".join(str(i) for i in sorted(rng.sample(range(16), rng.randint(1, 6))))
        parts = []
        for _ in range(rng.randint(1, 4)):
            lo = rng.randint(0, 200)
            parts.append(f"{lo}-{lo + rng.randint(0, 9)}" if rng.random() < 0.5 else str(lo))
        ids = ",".join(parts)
        wrapper.allow(allowed, "0")
        call = wrapper.run(["update", "--cpuset-cpus", ids, "c"])
        assert call.returncode == 0, call.stderr
        assert call.argv == ["update", "--cpuset-cpus", map_cpulist(ids, allowed), "c"], \
            (ids, allowed)


@pytest.mark.parametrize("cpu", [
    {"cpus": "0-1", "mems": "0"},
    {"cpus": "1", "mems": ""},
    {"shares": 1024},
    None,
])
def test_allowed_values_leave_the_file_untouched(wrapper: Wrapper, tmp_path: Path,
                                                 cpu: dict[str, object] | None) -> None:
    b = bundle(tmp_path, cpu)
    config = b / "config.json"
    before, text = config.stat(), config.read_bytes()
    call = wrapper.run(["create", "--bundle", str(b), "c"], config=config)
    assert call.returncode == 0, call.stderr
    after = config.stat()
    assert (after.st_ino, after.st_mtime_ns, config.read_bytes()) == (before.st_ino,
                                                                      before.st_mtime_ns, text)
    assert sorted(p.name for p in b.iterdir()) == ["config.json"]


def test_a_second_pass_is_a_no_op(wrapper: Wrapper, tmp_path: Path) -> None:
    b = bundle(tmp_path, {"cpus": "1-31,33-63", "mems": "1"})
    config = b / "config.json"
    wrapper.run(["create", "--bundle", str(b), "c"])
    first, text = config.stat(), config.read_bytes()
    wrapper.run(["create", "--bundle", str(b), "c"])
    assert (config.stat().st_ino, config.read_bytes()) == (first.st_ino, text)
    doc = json.loads(text)
    assert doc["annotations"]["hwsandbox.dev/emulated-cpus"] == "1-31,33-63"


# --- update -------------------------------------------------------------------------------

RESOURCES = {"cpu": {"cpus": "1-31,33-63", "mems": "1", "shares": 512, "quota": 100000},
             "memory": {"limit": 536870912}, "unified": {"memory.high": "max \\ \"x\""}}
MAPPED = {**RESOURCES, "cpu": {**RESOURCES["cpu"], "cpus": "0-1", "mems": "0"}}


def test_update_from_stdin_as_containerd_sends_it(wrapper: Wrapper, tmp_path: Path) -> None:
    args = [*go_runc_globals(tmp_path), "update", "--resources=-", "ctr-1"]
    call = wrapper.run(args, stdin=json.dumps(RESOURCES).encode() + b"\n", exit_code=3)
    assert call.returncode == 3
    assert call.argv == args
    assert call.runc_pid == call.wrapper_pid  # the here-document keeps it an exec
    assert json.loads(call.stdin) == MAPPED
    assert call.stdout == b"fake-runc-stdout\n"


def test_update_from_stdin_unchanged_when_allowed(wrapper: Wrapper) -> None:
    doc = {**RESOURCES, "cpu": {"cpus": "0-1", "mems": "0"}}
    text = json.dumps(doc, indent=1)
    call = wrapper.run(["update", "-r", "-", "c"], stdin=text.encode() + b"\n")
    assert call.argv == ["update", "-r", "-", "c"]
    assert call.stdin == text.encode() + b"\n"


@pytest.mark.parametrize("form", ["--resources F", "--resources=F", "-r F", "-r=F"])
def test_update_from_a_file(wrapper: Wrapper, tmp_path: Path, form: str) -> None:
    resources = tmp_path / "resources.json"
    resources.write_text(json.dumps(RESOURCES))
    flag, _, value = form.partition(" ")
    given = [flag, str(resources)] if value else [flag.replace("F", str(resources))]
    passed = [flag, "-"] if value else [flag.replace("F", "-")]
    call = wrapper.run(["--root", str(tmp_path), "update", *given, "ctr-1"])
    assert call.returncode == 0, call.stderr
    assert call.argv == ["--root", str(tmp_path), "update", *passed, "ctr-1"]
    assert json.loads(call.stdin) == MAPPED
    assert json.loads(resources.read_text()) == RESOURCES  # the caller's file is not edited


def test_update_from_a_file_unchanged_when_allowed(wrapper: Wrapper, tmp_path: Path) -> None:
    resources = tmp_path / "resources.json"
    resources.write_text(json.dumps({"cpu": {"cpus": "1", "mems": "0"}}))
    call = wrapper.run(["update", "--resources", str(resources), "c"], stdin=b"untouched")
    assert call.argv == ["update", "--resources", str(resources), "c"]
    assert call.stdin == b"untouched"


def test_update_with_a_document_larger_than_a_pipe(wrapper: Wrapper) -> None:
    devices = [{"allow": True, "type": "c", "major": i, "minor": 1, "access": "rwm"}
               for i in range(4000)]
    doc = {"cpu": {"cpus": "7", "mems": "1"}, "devices": devices}
    call = wrapper.run(["update", "--resources=-", "c"], stdin=json.dumps(doc).encode())
    assert call.returncode == 0, call.stderr
    assert len(call.stdin) > 65536
    assert json.loads(call.stdin) == {"cpu": {"cpus": "1", "mems": "0"}, "devices": devices}
    assert call.runc_pid == call.wrapper_pid


@pytest.mark.parametrize(("given", "passed"), [
    (["--cpuset-cpus", "1-31,33-63", "--cpuset-mems", "1"],
     ["--cpuset-cpus", "0-1", "--cpuset-mems", "0"]),
    (["--cpuset-cpus=5", "--cpuset-mems=1"], ["--cpuset-cpus=1", "--cpuset-mems=0"]),
    (["--memory", "1000", "--cpuset-cpus", "0"], ["--memory", "1000", "--cpuset-cpus", "0"]),
    (["--memory", "1000"], ["--memory", "1000"]),
])
def test_update_flags(wrapper: Wrapper, given: list[str], passed: list[str]) -> None:
    call = wrapper.run(["update", *given, "ctr-1"], stdin=b"stdin stays")
    assert call.returncode == 0, call.stderr
    assert call.argv == ["update", *passed, "ctr-1"]
    assert call.stdin == b"stdin stays"


# --- everything else ----------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ["state", "ctr-1"],
    ["kill", "ctr-1", "9"],
    ["delete", "--force", "ctr-1"],
    ["exec", "--process", "/run/p.json", "--detach", "--pid-file", "/run/p", "ctr-1"],
    ["ps", "--format", "json", "ctr-1"],
    ["features"],
    ["--version"],
    ["list"],
    [],
])
def test_other_subcommands_pass_through(wrapper: Wrapper, tmp_path: Path,
                                        args: list[str]) -> None:
    full = [*go_runc_globals(tmp_path), *args] if args else []
    # Unreadable allowed sets prove nothing is read for these verbs.
    call = wrapper.run(full, stdin=b"\x00raw stdin\n", exit_code=7,
                       env={"HWSB_CPUMAP_CPUS_FILE": "/nonexistent",
                            "HWSB_CPUMAP_MEMS_FILE": "/nonexistent"})
    assert (call.returncode, call.stdout, call.stderr) == (7, b"fake-runc-stdout\n",
                                                           "fake-runc-stderr\n")
    assert call.argv == full
    assert call.stdin == b"\x00raw stdin\n"
    assert call.runc_pid == call.wrapper_pid
    assert call.cwd == Path.cwd()


def test_help_passes_through_without_a_bundle(wrapper: Wrapper, tmp_path: Path) -> None:
    call = wrapper.run(["create", "--help"], cwd=tmp_path)
    assert (call.returncode, call.argv) == (0, ["create", "--help"])


# --- refusals -----------------------------------------------------------------------------

@pytest.mark.parametrize("hostile", ["0-4294967295", "99999999999999999999999", "65536",
                                     "0-65535,0-70000"])
def test_absurd_cpulists_are_refused(wrapper: Wrapper, tmp_path: Path, hostile: str) -> None:
    b = bundle(tmp_path, {"cpus": hostile, "mems": "0"})
    text = (b / "config.json").read_bytes()
    call = wrapper.run(["create", "--bundle", str(b), "c"])
    assert call.returncode == 1
    assert call.stderr.startswith("oci-cpumap: linux.resources.cpu.cpus: id ")
    assert "is above 65535: refused" in call.stderr
    assert call.stdout == b""
    assert not call.ran
    assert (b / "config.json").read_bytes() == text
    assert sorted(p.name for p in b.iterdir()) == ["config.json"]

    update = wrapper.run(["update", "--resources=-", "c"],
                         stdin=json.dumps({"cpu": {"mems": hostile}}).encode())
    assert update.returncode == 1
    assert update.stderr.startswith("oci-cpumap: cpu.mems: id ")
    assert not update.ran
    flag = wrapper.run(["update", "--cpuset-cpus", hostile, "c"])
    assert flag.returncode == 1
    assert flag.stderr.startswith("oci-cpumap: --cpuset-cpus: id ")
    assert not flag.ran


def test_a_range_as_wide_as_allowed_is_not_expanded(wrapper: Wrapper, tmp_path: Path) -> None:
    call = wrapper.run(["update", "--cpuset-cpus", ",".join(["0-65535"] * 2000), "c"])
    assert call.returncode == 0, call.stderr
    assert call.argv == ["update", "--cpuset-cpus", "0-1", "c"]


@pytest.mark.parametrize(("cpus", "message"), [
    ("1-a", 'not a cpulist: "1-a"'),
    ("3-1", "reversed range 3-1"),
    ("1-2-3", 'not a cpulist: "1-2-3"'),
    ("-1", 'not a cpulist: "-1"'),
])
def test_malformed_cpulists_are_refused(wrapper: Wrapper, cpus: str, message: str) -> None:
    call = wrapper.run(["update", "--cpuset-cpus", cpus, "c"])
    assert call.returncode == 1
    assert call.stderr == f"oci-cpumap: --cpuset-cpus: {message}\n"
    assert not call.ran


def test_integers_jq_cannot_keep_are_never_rounded(wrapper: Wrapper, tmp_path: Path) -> None:
    b = tmp_path / "b"
    b.mkdir()
    text = ('{"linux": {"resources": {"cpu": {"cpus": "5"}}, "seccomp": {"syscalls": '
            '[{"args": [{"value": 18446744073709551615}]}]}}}')
    (b / "config.json").write_text(text)
    exact = subprocess.run([need("jq"), "-n", "9007199254740993 | tojson"], capture_output=True,
                           text=True, check=True).stdout.strip() == '"9007199254740993"'
    call = wrapper.run(["create", "-b", str(b), "c"])
    if exact:  # jq >= 1.7 keeps the literal
        assert call.returncode == 0, call.stderr
        assert "18446744073709551615" in (b / "config.json").read_text()
    else:
        assert call.returncode == 1
        assert call.stderr.startswith(f"oci-cpumap: {b}/config.json: holds the integer ")
        assert "beyond what this jq (< 1.7) can rewrite exactly" in call.stderr
        assert (b / "config.json").read_text() == text
        assert not call.ran


def test_a_config_without_cpusets_goes_to_runc_unread(wrapper: Wrapper, tmp_path: Path) -> None:
    b = tmp_path / "b"
    b.mkdir()
    (b / "config.json").write_text('{"linux": ')  # runc reports what is wrong with it
    call = wrapper.run(["run", "-b", str(b), "c"], exit_code=1,
                       env={"HWSB_CPUMAP_CPUS_FILE": "/nonexistent"})
    assert (call.returncode, call.argv) == (1, ["run", "-b", str(b), "c"])
    assert call.runc_pid == call.wrapper_pid


def test_a_missing_config_is_an_error(wrapper: Wrapper, tmp_path: Path) -> None:
    call = wrapper.run(["create", "--bundle", str(tmp_path / "nope"), "c"])
    assert call.returncode == 1
    assert call.stderr == (f"oci-cpumap: {tmp_path}/nope/config.json: no such file "
                           "(runc create reads the bundle's config.json)\n")
    assert not call.ran


def test_invalid_json_is_an_error(wrapper: Wrapper, tmp_path: Path) -> None:
    b = tmp_path / "b"
    b.mkdir()
    truncated = '{"linux": {"resources": {"cpu": {"cpus": "1-3'
    (b / "config.json").write_text(truncated)
    call = wrapper.run(["run", "-b", str(b), "c"])
    assert call.returncode == 1
    assert f"oci-cpumap: {b}/config.json: not a valid OCI config (jq failed" in call.stderr
    assert call.stderr.endswith("; left unchanged\n")
    assert (b / "config.json").read_text() == truncated
    assert sorted(p.name for p in b.iterdir()) == ["config.json"]
    assert not call.ran

    update = wrapper.run(["update", "--resources=-", "c"], stdin=b"{nope")
    assert update.returncode == 1
    assert update.stderr.endswith("oci-cpumap: update: resources from stdin: not valid JSON or "
                                  "cannot be mapped; runc not started\n")
    assert not update.ran


def test_unreadable_allowed_set_is_an_error(wrapper: Wrapper, tmp_path: Path) -> None:
    b = bundle(tmp_path, {"cpus": "5"})
    call = wrapper.run(["create", "-b", str(b), "c"],
                       env={"HWSB_CPUMAP_CPUS_FILE": str(tmp_path / "none")})
    assert call.returncode == 1
    assert call.stderr == f"oci-cpumap: cannot read the allowed CPUs from any of: {tmp_path}/none\n"
    assert not call.ran
