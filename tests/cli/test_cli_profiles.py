"""Issue 26, through the installed ``sandbox`` console script: bundled profiles by name
(`sandbox profiles`, shipped in the wheel), a profile on stdin (``-``), "did you mean" for
a missing one, `sandbox list`, `--version` with the pinned versions and ``-v`` after the
verb. The last test installs the wheel outside the checkout and runs `up` from it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.cli import _env, build_wheel, sandbox, state_roots
from tests.support.fakehw_toy import require_fuse
from tests.support.paths import REPO

pytestmark = [pytest.mark.root, pytest.mark.fuse, pytest.mark.network]

BUNDLED = sorted(p.stem for p in (REPO / "profiles").glob("*.yaml"))


@pytest.fixture
def state_root() -> Iterator[Path]:
    yield from state_roots()


def test_profiles_lists_every_bundled_profile() -> None:
    table = sandbox("profiles")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["NAME", "NODES", "DEVICES", "DESCRIPTION"]
    assert [line.split()[0] for line in lines[1:]] == BUNDLED
    listed = json.loads(sandbox("profiles", "-o", "json").stdout)
    assert [p["name"] for p in listed] == BUNDLED
    by_name = {p["name"]: p for p in listed}
    demo = yaml.safe_load((REPO / "profiles" / "8gpu-2numa.yaml").read_text())
    assert by_name["8gpu-2numa"]["description"] == demo["metadata"]["description"]
    assert by_name["8gpu-2numa"]["nodes"] == 1
    assert by_name["workshop-mixed"]["nodes"] == 4
    assert "INVALID" not in table.stdout
    assert yaml.safe_load(sandbox("profiles", "-o", "yaml").stdout) == listed
    wide = sandbox("profiles", "-o", "wide").stdout
    assert str(REPO / "profiles" / "8gpu-2numa.yaml") in wide


@pytest.mark.parametrize("name", ["8gpu-2numa", "8gpu-2numa.yaml"])
def test_a_bundled_profile_by_name_anywhere(name: str, tmp_path: Path) -> None:
    """From a directory with no profiles/ in it, the name alone is enough."""
    ok = sandbox("validate", name, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "ok (1 node(s), 11 device(s))" in ok.stdout
    by_path = sandbox("show", str(REPO / "profiles" / "8gpu-2numa.yaml"), "-o", "json")
    assert sandbox("show", name, "-o", "json", cwd=tmp_path).stdout == by_path.stdout


def test_a_file_of_that_name_wins_over_the_bundled_one(tmp_path: Path) -> None:
    mine = tmp_path / "8gpu-2numa"
    mine.write_text((REPO / "profiles" / "mig-single.yaml").read_text())
    shown = sandbox("show", "8gpu-2numa", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("profile mig-single:"), shown.stdout


def test_a_missing_profile_says_what_was_meant(tmp_path: Path) -> None:
    by_name = sandbox("validate", "8gpu-2numo", cwd=tmp_path)
    assert by_name.returncode == 1
    assert ("8gpu-2numo:1:1: no such file (did you mean '8gpu-2numa'? `sandbox profiles` "
            "lists the bundled ones)") in by_name.stderr, by_name.stderr
    by_path = sandbox("validate", "profiles/8gpu-2numo.yaml")
    assert by_path.returncode == 1
    assert ("profiles/8gpu-2numo.yaml:1:1: no such file (did you mean "
            "'profiles/8gpu-2numa.yaml'?)") in by_path.stderr, by_path.stderr
    nothing = sandbox("up", "zzzz-nothing-like-it", "--runtime", "local",
                      env=_env(tmp_path / "state"))
    assert nothing.returncode == 1
    assert nothing.stderr == "error: zzzz-nothing-like-it:1:1: no such file\n"
    assert not (tmp_path / "state").exists()


def test_stdin_as_a_profile() -> None:
    text = (REPO / "profiles" / "mig-single.yaml").read_text()
    ok = sandbox("validate", "-", stdin=text)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == "-: ok (1 node(s), 4 device(s))\n"
    assert sandbox("show", "-", "-o", "json", stdin=text).stdout == \
        sandbox("show", "mig-single", "-o", "json").stdout
    broken = text.replace("model: a100-sxm4-80gb", "model: a100-sxm4-80gbx", 1)
    assert broken != text
    bad = sandbox("validate", "-", stdin=broken)
    assert bad.returncode == 1
    line = 1 + text[:text.index("a100-sxm4-80gb")].count("\n")
    assert bad.stderr.startswith(f"<stdin>:{line}:"), bad.stderr
    assert "Traceback" not in bad.stderr
    empty = sandbox("validate", "-", stdin="")
    assert empty.returncode == 1
    assert "<stdin>:1:1: empty file" in empty.stderr


def test_mount_daemon_refuses_stdin(tmp_path: Path) -> None:
    refused = sandbox("mount", "-", str(tmp_path / "root"), "--node", "gpu-worker",
                      "--daemon", stdin="")
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: mount --daemon cannot read the profile from "
                                     "standard input"), refused.stderr
    assert not (tmp_path / "root").exists()


def test_version_names_the_pinned_components() -> None:
    out = sandbox("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("sandbox 0.1.0 (Kubernetes v1.37.2, kind v0.32.0, "
                                 "containerd v2.4.2)"), out.stdout


def test_verbose_after_the_verb(tmp_path: Path) -> None:
    """``-v`` after the verb (and after a nested verb) is the same flag as before it."""
    for args in (["-v", "show", "nope.yaml"], ["show", "nope.yaml", "-v"],
                 ["show", "-v", "nope.yaml"]):
        out = sandbox(*args, cwd=tmp_path)
        assert out.returncode == 1, (args, out.stderr)
        assert "Traceback" in out.stderr, (args, out.stderr)
        assert out.stderr.rstrip().endswith("error: nope.yaml:1:1: no such file"), out.stderr
    quiet = sandbox("show", "nope.yaml", cwd=tmp_path)
    assert quiet.stderr == "error: nope.yaml:1:1: no such file\n"
    nested = sandbox("fault", "--socket", str(tmp_path / "none.sock"), "list", "-v")
    assert nested.returncode == 1
    assert "Traceback" in nested.stderr, nested.stderr


def test_list_without_sandboxes(state_root: Path) -> None:
    table = sandbox("list", env=_env(state_root))
    assert table.returncode == 0
    assert table.stdout == ""
    assert "no sandboxes; start one with `sandbox up 8gpu-2numa`" in table.stderr
    assert json.loads(sandbox("list", "-o", "json", env=_env(state_root)).stdout) == []


def test_up_by_name_and_from_stdin_then_list(state_root: Path) -> None:
    """Two local sandboxes, one from a bundled name, one from stdin; `list` shows both,
    `status` of the stdin one reads the copy kept in its state dir; down removes both."""
    require_fuse()
    env = _env(state_root)
    up = sandbox("up", "8gpu-2numa", "--runtime", "local", env=env, cwd=state_root)
    assert up.returncode == 0, up.stderr
    text = (REPO / "profiles" / "mig-single.yaml").read_text()
    up2 = sandbox("up", "-", "--runtime", "local", "--name", "from-stdin", stdin=text, env=env)
    assert up2.returncode == 0, up2.stderr
    # the first was alone: bare verbs; the second has a neighbour: its hints name it
    assert "\n  sandbox status  " in up.stdout, up.stdout
    assert "\n  sandbox status --name from-stdin  " in up2.stdout, up2.stdout
    assert "\n  sandbox down --name from-stdin  " in up2.stdout, up2.stdout
    listed = {s["name"]: s for s in json.loads(sandbox("list", "-o", "json", env=env).stdout)}
    assert set(listed) == {"8gpu-2numa", "from-stdin"}
    assert listed["8gpu-2numa"]["runtime"] == "local"
    assert listed["8gpu-2numa"]["state"] == "up"
    assert listed["8gpu-2numa"]["nodes"] == ["gpu-worker"]
    assert listed["8gpu-2numa"]["profile"] == str(REPO / "profiles" / "8gpu-2numa.yaml")
    copy = state_root / "from-stdin" / "profile.yaml"
    assert listed["from-stdin"]["profile"] == str(copy)
    assert copy.read_text() == text
    table = sandbox("list", env=env).stdout.splitlines()
    assert table[0].split() == ["NAME", "RUNTIME", "STATE", "NODES", "PROFILE"]
    assert table[1].split()[:4] == ["8gpu-2numa", "local", "up", "gpu-worker"]
    status = sandbox("status", "--name", "from-stdin", "-o", "json", env=env)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["profile"] == str(copy)
    fault = sandbox("fault", "--name", "from-stdin", "health", "mig-worker", "gpu1",
                    "unhealthy", env=env)
    assert fault.returncode == 0, fault.stderr
    for name in ("from-stdin", "8gpu-2numa"):
        down = sandbox("down", "--name", name, env=env)
        assert down.returncode == 0, down.stderr
    assert list(state_root.iterdir()) == []


def test_a_bad_profile_on_stdin_stops_up_before_anything(state_root: Path) -> None:
    text = (REPO / "profiles" / "mig-single.yaml").read_text().replace("sockets: 2",
                                                                       "sockets: two", 1)
    bad = sandbox("up", "-", "--runtime", "local", stdin=text, env=_env(state_root))
    assert bad.returncode == 1
    assert bad.stderr.startswith("error: <stdin>:"), bad.stderr
    assert "cpu.sockets" in bad.stderr, bad.stderr
    assert list(state_root.iterdir()) == []


def test_the_wheel_carries_the_profiles(tmp_path: Path) -> None:
    """Built as a user's ``pip install`` builds it and installed with its dependencies into
    a fresh virtualenv outside the checkout: the bundled profiles and plugin templates are
    there, and that virtualenv's ``sandbox up 8gpu-2numa`` (local runtime) works."""
    require_fuse()
    venv = tmp_path / "venv"
    wheel = build_wheel(tmp_path)
    for step in ([sys.executable, "-m", "venv", str(venv)],
                 # pyfuse3 with our patch, as scripts/install does (cached wheel)
                 [str(REPO / "scripts" / "build-pyfuse3"), str(venv / "bin" / "python")],
                 [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                  str(wheel)]):
        done = subprocess.run(step, capture_output=True, text=True, check=False, timeout=900)
        assert done.returncode == 0, (step, done.stderr)
    state = Path(tempfile.mkdtemp(prefix="hws-", dir="/tmp"))
    env = _env(state)
    env.pop("PYTHONPATH", None)
    # no kind on PATH here: the local runtime, as on a machine without Docker
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not (Path(p) / "kind").exists())

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(venv / "bin" / "sandbox"), *args], cwd=tmp_path, env=env,
                              text=True, capture_output=True, check=False, timeout=120)

    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sandbox; print(sandbox.__file__)"], cwd=tmp_path, env=env,
                          text=True, capture_output=True, check=True).stdout.strip()
    assert site.startswith(str(venv)), site
    try:
        listed = json.loads(run("profiles", "-o", "json").stdout)
        assert [p["name"] for p in listed] == BUNDLED
        assert all(p["file"].startswith(str(Path(site).parent / "data" / "profiles"))
                   for p in listed)
        # the plugin templates are package data too (sandbox.data.manifests)
        for extra in ((), ("--dra",)):
            template = run("plugins", "template", "--image", "acme/my-plugin:v1", *extra)
            assert template.returncode == 0, template.stderr
            assert "daemonset" in template.stdout.lower()
            assert "name: my-plugin" in template.stdout
        up = run("up", "8gpu-2numa")
        assert up.returncode == 0, up.stderr
        assert "is up (local runtime" in up.stdout
        status = run("status", "-o", "json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["profile"].startswith(str(venv))
        down = run("down")
        assert down.returncode == 0, down.stderr
    finally:
        for record in state.glob("*/sandbox.json"):
            run("down", "--name", record.parent.name)
        shutil.rmtree(state, ignore_errors=True)
