"""The resolved spec: its PCI tree is complete, and it round-trips through its JSON form.

Every profile in profiles/ and tests/data, and the fuzz corpora's mutated profiles that
resolve, dump to JSON and load back to an equal object that builds the same tree.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from sandbox.errors import ProfileError, SpecError
from sandbox.fakehw.builder import build_tree
from sandbox.profile import load_profile, load_profile_text, spec
from sandbox.profile.spec import Cluster, NodeSpec
from tests.profile.test_profile_fuzz import mutated_profiles
from tests.support.fuzz_inputs import PROFILE_KEYS, mutate, render_text, seed_profiles
from tests.support.paths import REPO as ROOT

PROFILES = sorted((ROOT / "profiles").glob("*.yaml")) + sorted((ROOT / "tests/data").glob("*.yaml"))
BRIDGE_CLASS = 0x060400


def _round_trip(cluster: Cluster) -> None:
    text = spec.dump(cluster)
    assert json.loads(text)["version"] == spec.FORMAT_VERSION
    assert spec.load(text) == cluster
    for node in cluster.nodes:
        back = spec.load_node(spec.dump(node))
        assert back == node
        assert spec.dump(back) == spec.dump(node)  # stable: the same text again


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_every_profile_round_trips(path: Path) -> None:
    _round_trip(load_profile(path).cluster)


@pytest.mark.parametrize("path", PROFILES[:3], ids=lambda p: p.name)
def test_a_loaded_spec_builds_the_same_tree(path: Path) -> None:
    node = load_profile(path).cluster.nodes[0]
    assert build_tree(spec.load_node(spec.dump(node))).digest() == build_tree(node).digest()


def test_fuzz_corpus_profiles_round_trip() -> None:
    """The mutated profiles of tests/support/fuzz_inputs.py (seeded as the fuzz test draws them)."""
    seeds = seed_profiles()
    resolved = 0
    for i in range(400):
        rng = random.Random(f"profile:17:{i}")
        text = render_text(mutate(rng.choice(seeds), rng, PROFILE_KEYS), rng)
        try:
            cluster = load_profile_text(text, f"fuzz-{i}.yaml").cluster
        except ProfileError:
            continue
        resolved += 1
        _round_trip(cluster)
    assert resolved > 20  # the corpus still reaches the resolver


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_profiles())
def test_mutated_profiles_round_trip(text: str) -> None:
    try:
        cluster = load_profile_text(text, "mutated.yaml").cluster
    except ProfileError:
        return
    _round_trip(cluster)


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_the_pci_tree_is_complete(path: Path) -> None:
    """Every function the node can show is planned once: bridges, PFs and every possible VF,
    nested below its parent, each bridge's bus range covering what is below it."""
    for node in load_profile(path).cluster.nodes:
        by_addr = {f.address: f for f in node.pci}
        assert [f.address for f in node.pci] == sorted(by_addr)
        for d in node.devices:
            for f in d.functions:
                assert by_addr[f.address] == f
                assert f.owner == d.id
            vfs = (d.nic.vf_addresses if d.nic else ()) + ((d.gpu.vf_addresses,) if d.gpu else ())
            for p, addresses in enumerate(a for a in vfs if a):
                for v, a in enumerate(addresses):
                    vf = by_addr[a]
                    assert (vf.owner, vf.physfn, vf.vf_index) == (d.id, d.functions[p].address, v)
        for f in node.pci:
            if f.parent is None:
                assert f.path == f"sys/devices/{f.host_bridge}/{f.address}"
                continue
            parent = by_addr[f.parent]
            assert f.path == f"{parent.path}/{f.address}"
            assert parent.class_code == BRIDGE_CLASS
            assert parent.secondary_bus <= f.bus <= parent.subordinate_bus
            assert parent.port_type in (4, 5, 6)
        assert node.bridges == tuple(f for f in node.pci if f.class_code == BRIDGE_CLASS)


def _doc(node: NodeSpec) -> dict[str, object]:
    return json.loads(spec.dump(node))  # type: ignore[no-any-return]


def _node() -> NodeSpec:
    return load_profile(ROOT / "profiles/sriov-rdma.yaml").cluster.nodes[0]


def test_bad_spec_files_are_refused_naming_the_field() -> None:
    node = _node()
    cases: list[tuple[str, str]] = [
        ("{", "not a resolved spec (not JSON: Expecting property name enclosed in double "
              "quotes: line 1 column 2 (char 1))"),
        ("[]", 'not a resolved spec (no "format": "hwsandbox.dev/resolved-spec")'),
    ]
    doc = _doc(node)
    doc["version"] = 99
    cases.append((json.dumps(doc), "resolved spec version 99; this sandbox reads version "
                                   f"{spec.FORMAT_VERSION} (resolve the profile again)"))
    doc = _doc(node)
    doc["spec"]["devices"][0]["numa_node"] = "0"  # type: ignore[index]
    cases.append((json.dumps(doc), "spec.devices[0].numa_node: expected int, got '0'"))
    doc = _doc(node)
    doc["spec"]["cpu"]["sockets"] = "{sockets}"  # type: ignore[index]
    cases.append((json.dumps(doc), "spec.cpu.sockets: expected int, got '{sockets}'"))
    doc = _doc(node)
    doc["spec"]["pci"][1]["device_id"] = [1]  # type: ignore[index]
    cases.append((json.dumps(doc), "spec.pci[1].device_id: expected int, got [1]"))
    doc = _doc(node)
    doc["spec"]["cpu"]["turbo"] = True  # type: ignore[index]
    cases.append((json.dumps(doc), "spec.cpu.turbo: unknown field"))
    doc = _doc(node)
    del doc["spec"]["memory"]  # type: ignore[attr-defined]
    cases.append((json.dumps(doc), "spec.memory: missing"))
    doc = _doc(node)
    doc["spec"]["devices"][0]["functions"] = ["0000:ff:1f.7"]  # type: ignore[index]
    cases.append((json.dumps(doc), "spec.devices[0].functions: '0000:ff:1f.7' is not a "
                                   "function in pci"))
    for text, message in cases:
        with pytest.raises(SpecError) as info:
            spec.load(text)
        assert str(info.value) == message
    cluster = load_profile(ROOT / "profiles/sriov-rdma.yaml").cluster
    with pytest.raises(SpecError, match="a Cluster, not a NodeSpec"):
        spec.load_node(spec.dump(cluster))


def test_read_node_picks_the_node_of_a_spec_file(tmp_path: Path) -> None:
    cluster = load_profile(ROOT / "profiles/workshop-mixed.yaml").cluster
    whole = tmp_path / "cluster.json"
    whole.write_text(spec.dump(cluster))
    one = tmp_path / "node.json"
    one.write_text(spec.dump(cluster.nodes[1]))
    name = cluster.nodes[1].name
    assert spec.read_node(whole, name) == cluster.nodes[1]
    assert spec.read_node(one) == cluster.nodes[1]
    assert spec.read_node(one, name) == cluster.nodes[1]
    names = ", ".join(n.name for n in cluster.nodes)
    for args, message in [
        ((whole,), f"{whole}: several nodes; pick one with --node ({names})"),
        ((whole, "nope"), f"{whole}: no node 'nope' (nodes: {names})"),
        ((one, "nope"), f"{one}: holds node {name!r}, not 'nope'"),
        ((tmp_path / "missing.json",),
         f"{tmp_path / 'missing.json'}: cannot read the resolved spec: No such file or directory"),
    ]:
        with pytest.raises(SpecError) as info:
            spec.read_node(*args)
        assert str(info.value) == message


def test_status_reads_the_spec_files_each_runtime_writes(tmp_path: Path) -> None:
    """`sandbox status` draws the spec a sandbox was brought up with: the local runtime's
    whole cluster in state/spec.json, the native one's node there, kind's one file per
    replica in state/nodes/<replica>/spec.json (in the record's order)."""
    from sandbox.cli.status import spec_files
    from sandbox.runtimes.record import NodeRecord, SandboxRecord
    from sandbox.session import Session

    cluster = load_profile(ROOT / "profiles" / "workshop-mixed.yaml").cluster
    local = tmp_path / "local"
    local.mkdir()
    (local / "spec.json").write_text(spec.dump(cluster))
    got = spec.read_cluster(spec_files(Session("local", local, SandboxRecord())), "local")
    assert got.nodes == cluster.nodes
    native = tmp_path / "native"
    native.mkdir()
    (native / "spec.json").write_text(spec.dump(cluster.nodes[1]))
    got = spec.read_cluster(spec_files(Session("n", native, SandboxRecord())))
    assert got.nodes == cluster.nodes[1:2]
    kind = tmp_path / "kind"
    order = [n.name for n in reversed(cluster.nodes)]
    for node in cluster.nodes:
        (kind / "nodes" / node.name).mkdir(parents=True)
        (kind / "nodes" / node.name / "spec.json").write_text(spec.dump(node))
    record = SandboxRecord(nodes={name: NodeRecord(root="", socket="") for name in order})
    got = spec.read_cluster(spec_files(Session("kind", kind, record)))
    assert [n.name for n in got.nodes] == order
    assert got.nodes == tuple(reversed(cluster.nodes))
    (kind / "nodes" / order[0] / "spec.json").write_text("{}")
    with pytest.raises(SpecError, match=f"nodes/{order[0]}/spec.json: not a resolved spec"):
        spec.read_cluster(spec_files(Session("kind", kind, record)))


def test_the_pci_plan_copies_functions_as_dataclasses_replace_does() -> None:
    """The resolver's fast copy of a PciFunction (pcitree._evolve, no ``__init__``) gives
    what ``dataclasses.replace`` gives: equal, same hash, a new object, the original
    unchanged; an unknown field is a TypeError, as there."""
    import dataclasses

    from sandbox.profile.resolve.pcitree import _evolve

    functions = [f for path in sorted((ROOT / "profiles").glob("*.yaml"))
                 for node in load_profile(path).cluster.nodes for f in node.pci]
    assert len(functions) > 100
    for f in functions:
        changes = {"path": f.path + "/x", "vf_index": f.vf_index + 1, "owner": "gpu9"}
        new = _evolve(f, **changes)
        assert new == dataclasses.replace(f, **changes)
        assert hash(new) == hash(dataclasses.replace(f, **changes))
        assert new is not f
        assert new != f
        assert _evolve(f) == f
    with pytest.raises(TypeError, match="no field"):
        _evolve(functions[0], colour="red")
