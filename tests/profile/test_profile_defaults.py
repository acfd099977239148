"""The fully defaulted profile (``sandbox show -o yaml|json``): a profile that validates
(also against the JSON Schema), resolves to the same cluster as the one it came from, and
is its own fully defaulted form."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
import yaml

from sandbox.errors import ProfileError
from sandbox.profile import load_profile, load_profile_text, spec
from sandbox.profile.defaults import defaulted_profile, quantity
from sandbox.profile.schema import profile_schema
from tests.support.fuzz_inputs import PROFILE_KEYS, mixed_case, mutate, render_text, seed_profiles
from tests.support.paths import REPO as ROOT

PROFILES = sorted((ROOT / "profiles").glob("*.yaml")) + sorted((ROOT / "tests/data").glob("*.yaml"))


@pytest.mark.parametrize(("nbytes", "written"), [
    (0, 0), (1, 1), (4096, "4Ki"), (2**20 * 512, "512Mi"), (80 * 2**30, "80Gi"),
    (2**40, "1Ti"), (3 * 2**40 + 2**30, "3073Gi"), (1536, 1536), (10**12, "976562500Ki"),
])
def test_quantity(nbytes: int, written: str | int) -> None:
    assert quantity(nbytes) == written


def _round_trip(text: str, name: str) -> bool:
    """False if ``text`` is not a valid profile; else asserts the defaulted form resolves
    the same, in YAML and in JSON, and defaults to itself."""
    try:
        loaded = load_profile_text(text, name)
    except ProfileError:
        return False
    doc = defaulted_profile(loaded.profile, loaded.cluster)
    for form in (yaml.safe_dump(doc, sort_keys=False), json.dumps(doc)):
        again = load_profile_text(form, f"defaulted-{name}")
        assert spec.dump(again.cluster) == spec.dump(loaded.cluster), name
        assert defaulted_profile(again.profile, again.cluster) == doc, name
    return True


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_every_profile_defaults_to_a_profile_that_resolves_the_same(path: Path) -> None:
    assert _round_trip(path.read_text(), path.name)
    loaded = load_profile(path)
    doc = defaulted_profile(loaded.profile, loaded.cluster)
    jsonschema.Draft202012Validator(profile_schema()).validate(doc)


def test_fuzz_corpus_profiles_default_to_the_same_cluster() -> None:
    """Mutated and mixed-vendor profiles of tests/support/fuzz_inputs.py that load: switches,
    given PCI addresses (new host bridges), hugepages, kubelet options, SR-IOV, partitions,
    one-CPU nodes... all default to a profile that resolves the same."""
    seeds = seed_profiles()
    resolved = 0
    for i in range(250):
        rng = random.Random(f"profile:17:{i}")
        text = render_text(mutate(rng.choice(seeds), rng, PROFILE_KEYS), rng)
        resolved += _round_trip(text, f"fuzz-{i}.yaml")
    for i in range(150):
        resolved += _round_trip(mixed_case(1, i, seeds), f"mixed-{i}.yaml")
    assert resolved > 60  # the corpus still reaches the resolver


def test_what_the_resolver_fills_in_is_stated() -> None:
    loaded = load_profile(ROOT / "profiles" / "workshop-mixed.yaml")
    doc = defaulted_profile(loaded.profile, loaded.cluster)
    control, gpu_worker, net_worker = doc["nodes"]
    assert control["kubelet"] == {
        "topologyManagerPolicy": "best-effort", "topologyManagerScope": "container",
        "cpuManagerPolicy": "static", "reservedSystemCPUs": "0",
        "memoryManagerPolicy": "None"}
    assert gpu_worker["numa"]["nodes"] == [
        {"id": 0, "cpus": "0-7,16-23", "memory": "64Gi", "hugepages": {}},
        {"id": 1, "cpus": "8-15,24-31", "memory": "64Gi", "hugepages": {}}]
    assert gpu_worker["pci"]["hostBridges"] == [
        {"domain": "0x0000", "bus": "0x00", "numaNode": 0},
        {"domain": "0x0000", "bus": "0x80", "numaNode": 1}]
    assert gpu_worker["devices"][0] == {
        "type": "gpu", "vendor": "nvidia", "model": "l40s", "name": "gpu", "count": 2,
        "numaNode": 0, "health": "healthy", "memory": "48Gi", "drm": False}
    nic, crypto = net_worker["devices"]
    assert (nic["speed"], nic["rdma"], nic["sriov"]) == (10000, False,
                                                         {"totalVFs": 8, "numVFs": 2})
    assert (crypto["vendorId"], crypto["classCode"], crypto["name"]) == (
        "0x8086", "0x0b4000", "crypto")
    assert "pciAddresses" not in nic  # stating them would move the device off its port
