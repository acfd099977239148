"""Every problem in one run: structural problems (types, unknown and missing fields) and
the cross-field ones of the parts that validated come out together, located and sorted,
and never a cross-field problem about a value that failed its type check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from sandbox.errors import ProfileError
from sandbox.profile import load_profile_text, model
from tests.support.paths import DATA

INVALID_DIR = DATA / "invalid"

BROKEN_NODE = "  - {name: broken, cpu: {sockets: many}}\n"


def _problems(text: str, name: str = "t.yaml") -> list[str]:
    with pytest.raises(ProfileError) as info:
        load_profile_text(text, name)
    return [str(p) for p in info.value.problems]


def _semantic_fixtures() -> list[Path]:
    """The invalid fixtures that are sound in structure (only cross-field rules fail) and
    end in a block list of nodes, which a broken node can be appended to."""
    out = []
    for path in sorted(INVALID_DIR.glob("*.yaml")):
        text = path.read_text()
        if "duplicate key" in path.with_suffix(".txt").read_text():
            continue  # a YAML-level problem, which stops before the model
        try:
            doc = yaml.safe_load(text)
            model.Profile.model_validate(doc)
        except Exception:  # noqa: BLE001 - not sound in structure (or not even YAML)
            continue
        if list(doc)[-1] == "nodes" and text.endswith("\n") and "\nnodes:\n  - " in text:
            out.append(path)
    return out


SEMANTIC = _semantic_fixtures()


def test_most_semantic_fixtures_are_covered() -> None:
    assert len(SEMANTIC) >= 20


@pytest.mark.parametrize("path", SEMANTIC, ids=lambda p: p.stem)
def test_a_broken_node_adds_its_problem_and_hides_none(path: Path) -> None:
    """Each semantic fixture's exact messages, plus the structural problem of a node
    appended to it: the rules still run on the nodes that validated, and their field paths
    (and messages naming other entries, as ``also nodes[0]``) are the document's."""
    text = path.read_text()
    expected = (path.with_suffix(".txt")).read_text().splitlines()
    nodes = len(yaml.safe_load(text)["nodes"])
    line = text.count("\n") + 1
    broken = (f"{path.name}:{line}:{BROKEN_NODE.index('many') + 1}: nodes[{nodes}].cpu."
              "sockets: must be a valid integer, unable to parse string as an integer, got "
              "'many'")
    assert _problems(text + BROKEN_NODE, path.name) == [*expected, broken]


_NODE_INDEX = re.compile(r"(?<![.\w])nodes\[(\d+)\]")  # not numa.nodes[k]


def _shifted(line: str, after: int) -> str:
    """An expected problem once a node is inserted as line ``after + 1``, first in the
    list: the lines below move down one, every ``nodes[k]`` is ``nodes[k + 1]``."""
    where, path, message = line.split(": ", 2)
    name, row, col = where.split(":")
    if int(row) > after and path != "nodes":  # the list itself still starts there
        row = str(int(row) + 1)
    path, message = (_NODE_INDEX.sub(lambda m: f"nodes[{int(m[1]) + 1}]", part)
                     for part in (path, message))
    return f"{name}:{row}:{col}: {path}: {message}"


@pytest.mark.parametrize("path", SEMANTIC, ids=lambda p: p.stem)
def test_a_broken_first_node_moves_nothing(path: Path) -> None:
    """The same with the broken node first: the nodes that validate are resolved as a
    profile of their own, and what they report maps back to the document's lines and
    indices (``nodes[1]``, ``also nodes[1]``)."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    at = lines.index("nodes:\n") + 1
    expected = [_shifted(line, at) for line in path.with_suffix(".txt").read_text()
                .splitlines()]
    broken = (f"{path.name}:{at + 1}:{BROKEN_NODE.index('many') + 1}: nodes[0].cpu.sockets: "
              "must be a valid integer, unable to parse string as an integer, got 'many'")
    problems = _problems("".join([*lines[:at], BROKEN_NODE, *lines[at:]]), path.name)
    assert problems == sorted([*expected, broken], key=_position)


def _position(problem: str) -> tuple[int, int]:
    _name, row, col = problem.split(": ", 1)[0].split(":")
    return int(row), int(col)


HEAD = """\
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: t}
nodes:
"""


def test_a_bad_node_before_a_duplicate_keeps_the_documents_indices() -> None:
    text = HEAD + """\
  - {name: a, cpu: {sockets: x}}
  - {name: n}
  - {name: n}
"""
    assert _problems(text) == [
        "t.yaml:5:30: nodes[0].cpu.sockets: must be a valid integer, unable to parse string "
        "as an integer, got 'x'",
        "t.yaml:7:12: nodes[2].name: duplicate node name 'n' (also nodes[1])",
    ]


def test_no_rule_runs_on_a_node_whose_cpu_failed() -> None:
    """Node a's NUMA nodes are not known: its device's numaNode 7 is not judged, its
    unknown model (which needs no node) is."""
    text = HEAD + """\
  - name: a
    cpu: {sockets: 2, coresPerSocket: 0}
    devices:
      - {type: gpu, vendor: nvidia, model: t4, numaNode: 7}
      - {type: gpu, vendor: amd, model: mi300, numaNode: 7}
"""
    assert _problems(text) == [
        "t.yaml:6:39: nodes[0].cpu.coresPerSocket: must be greater than or equal to 1, got 0",
        "t.yaml:9:41: nodes[0].devices[1].model: unknown amd gpu model 'mi300' (did you mean "
        "'mi300x'?); known: mi210, mi250x, mi300x",
    ]


def test_a_field_no_rule_reads_does_not_stop_the_node() -> None:
    """A wrong kubelet policy or label is left to its default: the node's own rules
    (NUMA node of a device, memory) still run."""
    text = HEAD + """\
  - name: a
    labels: {"bad key!": x}
    kubelet: {topologyManagerPolicy: strict}
    memory: 8Gi
    numa: {nodes: [{id: 0, memory: 16Gi}]}
    devices:
      - {type: gpu, vendor: nvidia, model: t4, numaNode: 1}
"""
    assert _problems(text) == [
        "t.yaml:6:14: nodes[0].labels.bad key!: must be a label key: [prefix/]name, the name "
        "at most 63 letters, digits, '-', '_' or '.', got 'bad key!'",
        "t.yaml:7:38: nodes[0].kubelet.topologyManagerPolicy: 'strict' is not one of "
        "'none', 'best-effort', 'restricted', 'single-numa-node' (did you mean "
        "'restricted'?)",
        "t.yaml:8:13: nodes[0].memory: total 8Gi differs from the NUMA nodes' sum 16Gi",
        "t.yaml:11:58: nodes[0].devices[0].numaNode: no NUMA node 1 (have 0)",
    ]


def test_a_value_that_failed_its_type_is_not_judged_again() -> None:
    text = HEAD + """\
  - name: a
    devices:
      - {type: gpu, vendor: nvidia, model: t4, count: 2x, pciAddresses: ["0000:3b:00.0"]}
      - {type: gpu, vendor: nvidia, model: t4, numaNode: one}
      - {type: nic, vendor: intel, model: x710, sriov: {totalVFs: 100, numVFs: a}}
"""
    problems = _problems(text)
    assert [p.split(": ")[1] for p in problems] == [
        "nodes[0].devices[0].count", "nodes[0].devices[1].numaNode",
        "nodes[0].devices[2].sriov.numVFs"]


def test_a_bad_metadata_does_not_stop_the_rules() -> None:
    text = """\
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: Not_A_Label}
nodes:
  - {name: a, devices: [{type: gpu, vendor: nvidia, model: t4, numaNode: 1}]}
"""
    assert _problems(text) == [
        "t.yaml:3:18: metadata.name: must be a DNS label: lowercase letters, digits and '-', "
        "starting and ending alphanumeric, got 'Not_A_Label'",
        "t.yaml:5:74: nodes[0].devices[0].numaNode: no NUMA node 1 (have 0)",
    ]


def test_yaml_level_problems_still_stop_first() -> None:
    """A duplicate key: which value counts is not known, so nothing is judged."""
    text = HEAD + """\
  - name: a
    memory: 8Gi
    memory: 16Gi
    devices: [{type: gpu, vendor: nvidia, model: t4, numaNode: 1}]
"""
    assert _problems(text) == ["t.yaml:7:5: nodes[0].memory: duplicate key"]


def test_a_bad_nodes_list_stops_the_rules() -> None:
    text = HEAD.replace("nodes:\n", "nodes: {a: 1}\n")
    assert _problems(text) == [
        "t.yaml:4:8: nodes: must be a valid list"]


def test_a_device_left_out_with_addresses_stops_its_node() -> None:
    """Device 0's given address makes NUMA node 1's only host bridge: without it, device 1
    would have none. So its node is not resolved while device 0 is broken."""
    node = HEAD + """\
  - name: a
    cpu: {sockets: 2}
    pci: {hostBridges: [{bus: 0, numaNode: 0}]}
    devices:
      - {type: gpu, vendor: nvidia, model: t4, numaNode: 1, pciAddresses: ["0000:81:00.0"]}
      - {type: gpu, vendor: nvidia, model: t4, numaNode: 1}
"""
    load_profile_text(node, "t.yaml")
    broken = node.replace('00.0"]}', '00.0"], colour: red}')
    assert _problems(broken) == [
        "t.yaml:9:93: nodes[0].devices[0].colour: unknown field 'colour' (allowed: count, "
        "drm, health, healthReason, memory, model, name, numaNode, partitions, pciAddresses, "
        "sriov, switch, type, vendor)"]


def test_a_device_left_out_does_not_renumber_dev_nodes() -> None:
    """Without generic device 1, device 2 would be acc1, its node c1 char 10:196: the vfio
    driver's. As written it is acc2 (10:197), no clash; so no devNodes check while device 1
    is broken."""
    node = HEAD + """\
  - name: a
    devices:
      - {type: generic, name: acc, vendorId: 1, deviceId: 1, classCode: 1}
      - {type: generic, name: acc, vendorId: 1, deviceId: 1, classCode: 1,
         devNodes: [{name: "x{i}", major: 240, minor: 0}]}
      - {type: generic, name: acc, vendorId: 1, deviceId: 1, classCode: 1,
         devNodes: [{name: "c{i}", major: 10, minor: 195}]}
"""
    load_profile_text(node, "t.yaml")
    broken = node.replace("minor: 0}]}\n      - {type: generic, name: acc",
                          "minor: 0}], colour: red}\n      - {type: generic, name: acc", 1)
    assert [p.split(": ")[1] for p in _problems(broken)] == ["nodes[0].devices[1].colour"]
