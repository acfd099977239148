"""Issue 26 items 3-5, through the installed ``sandbox`` console script: `validate` reports
structural and semantic problems in one run; `show -o yaml|json` is a fully defaulted
profile that validates and renders the same tree; the JSON Schema enumerates the
catalogue's models per vendor and device type."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from sandbox.profile import catalogue
from tests.support.cli import sandbox
from tests.support.paths import REPO

pytestmark = [pytest.mark.root]

BUNDLED = sorted(p.stem for p in (REPO / "profiles").glob("*.yaml"))

# -- 3. every problem in one run ----------------------------------------------------------

# Structural problems (types, unknown fields) next to semantic ones (unknown model, NUMA
# node out of range, InfiniBand on an Intel NIC), and values that fail their type check
# where the same value would also break a rule (count "two" against one pciAddress,
# numaNode "x"): those must give the type error alone. Node a's CPU is unknown, so only
# what needs no node is checked of its devices (the model); node b's role is read by no
# rule, so b is resolved with the devices that validated.
MIXED = """\
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata:
  name: mixed
nodes:
  - name: a
    cpu: {sockets: 2, threadsPerCore: two}
    devices:
      - {type: gpu, vendor: nvidia, model: h100, numaNode: 1}
      - {type: gpu, vendor: nvidia, model: t4, colour: green}
      - {type: gpu, vendor: nvidia, model: t4, count: two, pciAddresses: ["0000:3b:00.0"]}
  - name: b
    role: master
    devices:
      - {type: gpu, vendor: nvidia, model: h100-sxm5-80gb, numaNode: 3}
      - {type: nic, vendor: intel, model: x710, numaNode: x}
      - {type: nic, vendor: intel, model: x710, linkLayer: infiniband}
"""
STRUCTURAL = [
    "mixed.yaml:7:39: nodes[0].cpu.threadsPerCore: must be a valid integer, unable to "
    "parse string as an integer, got 'two'",
    "mixed.yaml:10:48: nodes[0].devices[1].colour: unknown field 'colour' (allowed: count, "
    "drm, health, healthReason, memory, model, name, numaNode, partitions, pciAddresses, "
    "sriov, switch, type, vendor)",
    "mixed.yaml:11:55: nodes[0].devices[2].count: must be a valid integer, unable to parse "
    "string as an integer, got 'two'",
    "mixed.yaml:13:11: nodes[1].role: 'master' is not one of 'control-plane', 'worker'",
    "mixed.yaml:16:59: nodes[1].devices[1].numaNode: must be a NUMA node id (0 or more), "
    "or none for no NUMA affinity, got 'x'",
]
SEMANTIC = [
    "mixed.yaml:9:44: nodes[0].devices[0].model: unknown nvidia gpu model 'h100'; known: "
    "a100-pcie-40gb, a100-sxm4-40gb, a100-sxm4-80gb, h100-sxm5-80gb, l40s, t4",
    "mixed.yaml:15:70: nodes[1].devices[0].numaNode: no NUMA node 3 (have 0)",
    "mixed.yaml:17:60: nodes[1].devices[2].linkLayer: InfiniBand needs a mellanox NIC",
]


def _position(line: str) -> tuple[int, int]:
    _file, row, col = line.split(": ", 1)[0].split(":")
    return int(row), int(col)


def test_validate_reports_structural_and_semantic_problems_in_one_run(tmp_path: Path) -> None:
    (tmp_path / "mixed.yaml").write_text(MIXED)
    result = sandbox("validate", "mixed.yaml", cwd=tmp_path)
    assert result.returncode == 1
    expected = sorted(STRUCTURAL + SEMANTIC, key=_position)
    assert result.stderr.splitlines() == [*expected, "1 of 1 profile(s) invalid"]
    assert "Traceback" not in result.stderr


def test_fixing_the_structure_reveals_no_new_problem(tmp_path: Path) -> None:
    """The second run after fixing only the structural problems finds what the first one
    already reported, at the same places: nothing was held back."""
    fixed = (MIXED.replace("threadsPerCore: two", "threadsPerCore: 2    ")
             .replace(", colour: green", "")
             .replace("count: two,", "count: 1,  ")
             .replace("numaNode: x}", "numaNode: 0}")
             .replace("role: master", "role: worker"))
    (tmp_path / "mixed.yaml").write_text(fixed)
    result = sandbox("validate", "mixed.yaml", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [*SEMANTIC, "1 of 1 profile(s) invalid"]


def test_validate_stdin_reports_both_kinds_too() -> None:
    result = sandbox("validate", "-", stdin=MIXED)
    assert result.returncode == 1
    lines = result.stderr.splitlines()[:-1]
    assert [line.replace("<stdin>:", "mixed.yaml:", 1) for line in lines] == sorted(
        STRUCTURAL + SEMANTIC, key=_position)


# -- 4. show -o yaml|json: a fully defaulted profile ----------------------------------------

SNAKE = re.compile(r"^[a-z0-9]+(_[a-z0-9]+)+$")


def _keys(doc: Any, under: str = "") -> list[str]:
    """Every field name of a profile document (not the keys of labels or hugepages)."""
    if isinstance(doc, list):
        return [k for item in doc for k in _keys(item, under)]
    if not isinstance(doc, dict) or under in ("labels", "hugepages"):
        return []
    return [k for key, value in doc.items() for k in (key, *_keys(value, key))]


@pytest.mark.parametrize("name", BUNDLED)
def test_show_yaml_is_a_profile_that_resolves_the_same(name: str, tmp_path: Path) -> None:
    shown = sandbox("show", name, "-o", "yaml")
    assert shown.returncode == 0, shown.stderr
    doc = yaml.safe_load(shown.stdout)
    assert (doc["apiVersion"], doc["kind"]) == ("hwsandbox.dev/v1alpha1", "HardwareProfile")
    assert not [k for k in _keys(doc) if SNAKE.match(k)]
    as_json = sandbox("show", name, "-o", "json")
    assert json.loads(as_json.stdout) == doc
    # fully defaulted: what the original leaves out is stated
    for node in doc["nodes"]:
        assert {"count", "role", "kubelet", "cpu", "memory", "numa", "pci", "devices"} <= set(
            node)
        assert all(n["cpus"] is not None and "memory" in n for n in node["numa"]["nodes"])
        assert len(node["numa"]["distances"]) == len(node["numa"]["nodes"])
        assert all({"count", "numaNode", "health", "name"} <= set(d) for d in node["devices"])
    out = tmp_path / f"{name}.yaml"
    out.write_text(shown.stdout)
    (tmp_path / f"{name}.json").write_text(as_json.stdout)
    ok = sandbox("validate", str(out), str(tmp_path / f"{name}.json"))
    assert ok.returncode == 0, ok.stderr
    original = sandbox("show", name, "-o", "spec")
    again = sandbox("show", str(out), "-o", "spec")
    assert original.returncode == 0, original.stderr
    assert again.stdout == original.stdout
    # and stating every default is a fixed point
    assert sandbox("show", str(out), "-o", "yaml").stdout == shown.stdout


def _tree(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for entry in dirnames + filenames:
            path = Path(dirpath) / entry
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "-> " + os.readlink(path)
            elif path.is_file():
                out[rel] = path.read_bytes().hex()
            else:
                out[rel] = "dir"
    return out


def test_show_yaml_renders_the_same_tree(tmp_path: Path) -> None:
    shown = sandbox("show", "mig-single", "-o", "yaml")
    (tmp_path / "round.yaml").write_text(shown.stdout)
    for profile, out in (("mig-single", "a"), (str(tmp_path / "round.yaml"), "b")):
        rendered = sandbox("render", profile, "--out", str(tmp_path / out))
        assert rendered.returncode == 0, rendered.stderr
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
    assert len(a) > 100
    assert a == b


# -- 5. the schema enumerates the catalogue's models ---------------------------------------


def _schema() -> jsonschema.Draft202012Validator:
    printed = sandbox("schema")
    assert printed.returncode == 0, printed.stderr
    schema = json.loads(printed.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _model_errors(validator: jsonschema.Draft202012Validator, doc: Any) -> list[str]:
    """The schema's complaints about a device's ``model`` (inside the device union)."""
    found = []
    for error in validator.iter_errors(doc):
        for e in [error, *(c for c in error.context or ())]:
            if list(e.absolute_path)[-1:] == ["model"]:
                found.append(e.message)
    return found


def test_schema_accepts_every_bundled_profile_and_rejects_a_wrong_model() -> None:
    validator = _schema()
    for name in BUNDLED:
        doc = yaml.safe_load((REPO / "profiles" / f"{name}.yaml").read_text())
        assert not list(validator.iter_errors(doc)), name
    doc = yaml.safe_load((REPO / "profiles" / "8gpu-2numa.yaml").read_text())
    gpu = next(d for d in doc["nodes"][0]["devices"] if d["type"] == "gpu")
    for wrong in ("h100", "mi300x", "connectx-7"):  # a typo, AMD's, a NIC's
        gpu["model"] = wrong
        assert list(validator.iter_errors(doc)), wrong
        assert _model_errors(validator, doc), wrong
    gpu["model"] = "a100-sxm4-80gb"
    assert not list(validator.iter_errors(doc))


def test_schema_lists_models_per_vendor_and_type_generic_stays_free() -> None:
    validator = _schema()
    defs = validator.schema["$defs"]
    for cls, table in (("Gpu", catalogue.GPUS), ("Nic", catalogue.NICS),
                       ("Fpga", catalogue.FPGAS), ("Nvme", catalogue.NVMES)):
        assert set(defs[cls]["properties"]["model"]["enum"]) == {
            m for models in table.values() for m in models}
        per_vendor = {rule["if"]["properties"]["vendor"]["const"]:
                      set(rule["then"]["properties"]["model"]["enum"])
                      for rule in defs[cls]["allOf"]}
        assert per_vendor == {vendor: set(models) for vendor, models in table.items()}
    assert "enum" not in defs["Generic"]["properties"]["model"]
    doc = {"apiVersion": "hwsandbox.dev/v1alpha1", "kind": "HardwareProfile",
           "metadata": {"name": "t"},
           "nodes": [{"name": "n", "devices": [
               {"type": "generic", "vendorId": "0x8086", "deviceId": "0x4940",
                "classCode": "0x0b4000", "model": "my own accelerator"},
               {"type": "nvme", "vendor": "kioxia", "model": "cm6"},
               {"type": "nic", "vendor": "mellanox", "model": "connectx-7"}]}]}
    assert not list(validator.iter_errors(doc))
    doc["nodes"][0]["devices"][1]["vendor"] = "samsung"  # cm6 is KIOXIA's
    assert _model_errors(validator, doc)
