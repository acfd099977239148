"""Profiles: the shipped library loads, bad input gives exact located messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from sandbox.errors import ProfileError
from sandbox.profile import load_profile
from sandbox.profile.schema import profile_schema, schema_text
from tests.support.paths import DATA
from tests.support.paths import REPO as ROOT

PROFILES = sorted((ROOT / "profiles").glob("*.yaml"))
INVALID_DIR = DATA / "invalid"
INVALID = sorted(INVALID_DIR.glob("*.yaml"))

# Fixtures whose problems are about structure (types, unknown or missing keys, YAML
# itself) rather than cross-field rules: the JSON Schema must reject these too.
STRUCTURAL = {
    "bad-name", "bad-numa-none", "bad-quantity", "bad-vendor", "generic-missing", "list-doc",
    "many-problems",
    "missing-api", "missing-type", "no-nodes", "pci-malformed", "scalar-doc", "typo-cpu",
    "unknown-top", "unknown-type", "wrong-api", "wrong-kind", "zero-count",
}


def sandbox(*args: str, cwd: Path = ROOT, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox", *args], cwd=cwd, capture_output=True, text=True,
        check=False, **kw,  # type: ignore[arg-type]
    )


def test_there_are_enough_invalid_fixtures() -> None:
    assert len(INVALID) >= 25


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_fixture_gives_exact_messages(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = path.with_suffix(".txt").read_text().splitlines()
    assert expected, f"{path.name}: the .txt beside it lists the expected messages"
    monkeypatch.chdir(INVALID_DIR)
    with pytest.raises(ProfileError) as info:
        load_profile(path.name)
    assert [str(p) for p in info.value.problems] == expected


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_shipped_profile_is_valid(path: Path) -> None:
    loaded = load_profile(path)
    assert loaded.cluster.nodes


def test_cli_validate_all_profiles_exit_zero() -> None:
    result = sandbox("validate", *(str(p.relative_to(ROOT)) for p in PROFILES))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": ok (") == len(PROFILES)


def test_cli_validate_reports_every_problem_without_traceback() -> None:
    result = sandbox("validate", "many-problems.yaml", "empty.yaml", cwd=INVALID_DIR)
    assert result.returncode == 1
    expected = (INVALID_DIR / "many-problems.txt").read_text() + (
        INVALID_DIR / "empty.txt"
    ).read_text()
    assert result.stderr == expected + "2 of 2 profile(s) invalid\n"
    assert "Traceback" not in result.stderr


def test_cli_directory_and_missing_file(tmp_path: Path) -> None:
    result = sandbox("validate", str(tmp_path), str(tmp_path / "nope.yaml"))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"{tmp_path}:1:1: is a directory, not a profile file",
        f"{tmp_path}/nope.yaml:1:1: no such file",
        "2 of 2 profile(s) invalid",
    ]


def test_cli_unreadable_file(tmp_path: Path) -> None:
    secret = tmp_path / "secret.yaml"
    secret.write_text(PROFILES[0].read_text())
    secret.chmod(0o000)
    cmd = [sys.executable, "-m", "sandbox", "validate", str(secret)]
    if os.geteuid() == 0:
        # Root reads everything: drop the capabilities that override file permissions.
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[0] == f"{secret}:1:1: permission denied"


def test_cli_show_8gpu_has_four_gpus_per_numa_node() -> None:
    result = sandbox("show", "profiles/8gpu-2numa.yaml")
    assert result.returncode == 0, result.stderr
    sections = result.stdout.split("\n  NUMA ")[1:]
    assert len(sections) == 2
    for numa, section in enumerate(sections):
        assert section.startswith(f"{numa}  CPUs ")
        gpus = [line for line in section.splitlines() if line.split()[1:2] == ["gpu"]]
        assert len(gpus) == 4
        assert all("NVIDIA H100" in g for g in gpus)


def test_cli_show_json_is_the_defaulted_profile() -> None:
    result = sandbox("show", "-o", "json", "profiles/8gpu-2numa.yaml")
    data = json.loads(result.stdout)
    assert (data["apiVersion"], data["kind"]) == ("hwsandbox.dev/v1alpha1", "HardwareProfile")
    node = data["nodes"][0]
    assert [n["id"] for n in node["numa"]["nodes"]] == [0, 1]
    assert [n["cpus"] for n in node["numa"]["nodes"]] == ["0-15,32-47", "16-31,48-63"]
    gpus = [d for d in node["devices"] if d["type"] == "gpu"]
    assert sum(d["count"] for d in gpus) == 8
    assert {(d["vendor"], d["model"], d["memory"]) for d in gpus} == {
        ("nvidia", "h100-sxm5-80gb", "80Gi")}


def test_cli_show_spec_is_the_resolved_model() -> None:
    result = sandbox("show", "-o", "spec", "profiles/8gpu-2numa.yaml")
    node = json.loads(result.stdout)["spec"]["nodes"][0]
    assert [n["id"] for n in node["numa"]] == [0, 1]
    gpus = [d for d in node["devices"] if d["kind"] == "gpu"]
    assert len(gpus) == 8
    pci = {f["address"]: f for f in node["pci"]}
    assert {pci[d["functions"][0]]["vendor_id"] for d in gpus} == {0x10DE}
    assert all(d["uuid"].startswith("GPU-") for d in gpus)


def test_show_error_is_one_line_and_traceback_only_with_verbose(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: [")
    plain = sandbox("show", str(bad))
    assert plain.returncode == 1
    assert plain.stderr.startswith(f"error: {bad}:1:14: invalid YAML: ")
    assert len(plain.stderr.splitlines()) == 1
    verbose = sandbox("-v", "show", str(bad))
    assert "Traceback" in verbose.stderr


def test_resolution_is_deterministic_and_replicas_differ_only_in_identity() -> None:
    a = load_profile(ROOT / "profiles" / "workshop-mixed.yaml").cluster
    b = load_profile(ROOT / "profiles" / "workshop-mixed.yaml").cluster
    assert a == b
    w0, w1 = a.node("gpu-worker", 0), a.node("gpu-worker", 1)
    assert w0 is not None
    assert w1 is not None
    assert (w0.name, w1.name) == ("gpu-worker-0", "gpu-worker-1")
    assert [d.address for d in w0.devices] == [d.address for d in w1.devices]
    assert {d.uuid for d in w0.devices}.isdisjoint({d.uuid for d in w1.devices})


def test_8gpu_layout() -> None:
    node = load_profile(ROOT / "profiles" / "8gpu-2numa.yaml").cluster.nodes[0]
    assert [n.cpus[:2] for n in node.numa] == [(0, 1), (16, 17)]
    assert node.numa[0].cpus[16] == 32  # hyperthread siblings follow the first threads
    assert [d.numa_node for d in node.devices if d.kind == "gpu"] == [0] * 4 + [1] * 4
    addresses = [f.address for d in node.devices for f in d.functions]
    assert len(addresses) == len(set(addresses))


# -- JSON Schema --------------------------------------------------------------------------


def test_schema_file_in_package_is_current() -> None:
    shipped = ROOT / "sandbox" / "profile" / "schema.json"
    assert shipped.read_text() == schema_text(), "run: python -m sandbox schema > " + str(shipped)


def test_cli_schema_prints_the_schema() -> None:
    result = sandbox("schema")
    assert json.loads(result.stdout) == profile_schema()


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_schema_accepts_shipped_profile(path: Path) -> None:
    jsonschema.Draft202012Validator(profile_schema()).validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("name", sorted(STRUCTURAL))
def test_schema_rejects_structural_errors(name: str) -> None:
    data = yaml.safe_load((INVALID_DIR / f"{name}.yaml").read_text())
    errors = list(jsonschema.Draft202012Validator(profile_schema()).iter_errors(data))
    assert errors, f"{name}.yaml passes the schema but the loader rejects it"


def test_validate_exit_status_survives_a_reader_that_goes_away() -> None:
    bad = INVALID_DIR / "many-problems.yaml"
    result = subprocess.run(
        f"{sys.executable} -m sandbox validate {bad} {bad} {bad} 2>&1 | head -1; "
        "echo \"status ${PIPESTATUS[0]}\"", shell=True, executable="/bin/bash",
        capture_output=True, text=True, cwd=ROOT, check=False, timeout=60)
    assert result.stdout.splitlines()[-1] == "status 1"
    assert "Traceback" not in result.stdout + result.stderr


def test_validate_refuses_a_fifo_instead_of_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "profile.yaml"
    os.mkfifo(fifo)
    result = subprocess.run([sys.executable, "-m", "sandbox", "validate", str(fifo)], cwd=ROOT,
                            capture_output=True, text=True, check=False, timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith(f"{fifo}:1:1: not a regular file")
