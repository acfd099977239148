"""`sandbox dra claims` on a cluster with the REAL scheduler: what it shows is what the
API objects say (which claim holds which partition or NIC share, what is left), as a
table, as JSON and in the picture (``-o svg|png``)."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from kubernetes.utils.quantity import parse_quantity

from sandbox.draclaims import quantity, usage
from sandbox.draw import claims_svg
from tests.plugins.dra.cluster import GROUP, REPO, VERSION, Cluster, Node, attr, cel
from tests.plugins.dra.cluster import cluster as start
from tests.plugins.dra.cluster import name as _name

pytestmark = [pytest.mark.root, pytest.mark.network]

NODES = {"dra-worker": Node("tests/data/dra-nic-gpu.yaml")}
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with start(NODES) as c:
        yield c


def test_claims_view_matches_the_api_objects(cluster: Cluster, tmp_path: Path) -> None:
    nic = {"deviceClassName": "nic.hwsandbox.dev", "capacity": {"requests": {"bandwidth": "3G"}}}
    part = {"deviceClassName": "gpu-partition.hwsandbox.dev",
            "selectors": cel(f'{attr("profile")} == "1g.10gb"')}
    claims = {_name("bw"): nic, _name("bw"): nic, _name("mig"): part}
    for n, request in claims.items():  # one after another: test_scheduler.py's NIC race
        cluster.claim(n, request)
        cluster.pod(n, "dra-worker", claim=n)
        cluster.wait(f"claim {n} reserved for its pod", lambda n=n: (
            cluster.get_claim(n).get("status") or {}).get("reservedFor"))

    slices = cluster.objects.list_cluster_custom_object(GROUP, VERSION, "resourceslices")
    objects = cluster.objects.list_cluster_custom_object(GROUP, VERSION, "resourceclaims")
    use = usage(slices["items"], objects["items"])
    # every allocation result of every claim, with the pod it is reserved for
    want = {(f"default/{c['metadata']['name']}", r["device"], r["pod"] if "pod" in r else
             c["status"]["reservedFor"][0]["name"])
            for c in objects["items"] for r in c["status"]["allocation"]["devices"]["results"]}
    assert {(a.claim, a.device, a.pods[0]) for a in use.allocated} == want
    # the NIC: two 3G shares of its 10G bandwidth
    [bw] = [x for x in use.capacity if x.name == "bandwidth"]
    assert (bw.total, bw.used) == (parse_quantity("10G"), parse_quantity("6G"))
    # the GPU: what its counter set has, less what the 1g.10gb partition consumes
    [mig] = [a for a in use.allocated if a.claim.startswith("default/mig-")]
    device = next(d for s in slices["items"] for d in s["spec"].get("devices", [])
                  if d["name"] == mig.device)
    for cc in device["consumesCounters"]:
        for counter, value in cc["counters"].items():
            [left] = [x for x in use.counters
                      if (x.owner, x.name) == (cc["counterSet"], counter)]
            assert left.used == parse_quantity(value["value"])
            assert left.total > left.used >= Decimal(0)

    # the CLI prints the same, as a table and as JSON
    out = subprocess.run([sys.executable, "-m", "sandbox", "dra", "claims", "--kubeconfig",
                          str(cluster.cp.kubeconfig)], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    for claim, device, pod in want:
        assert any(claim in line and device in line and pod in line
                   for line in out.splitlines()), out
    assert "bandwidth  6G    4G    10G" in out, out
    data = json.loads(subprocess.run(
        [sys.executable, "-m", "sandbox", "dra", "claims", "--kubeconfig",
         str(cluster.cp.kubeconfig), "-o", "json"], cwd=REPO, capture_output=True, text=True,
        check=True, timeout=60).stdout)
    assert len(data["allocated"]) == len(want)
    assert yaml.safe_load(subprocess.run(
        [sys.executable, "-m", "sandbox", "dra", "claims", "--kubeconfig",
         str(cluster.cp.kubeconfig), "-o", "yaml"], cwd=REPO, capture_output=True, text=True,
        check=True, timeout=60).stdout) == data

    # the picture: every claim with its pod and device, what is left of every counter
    picture = ET.fromstring(claims_svg(use))
    drawn = {(g.get("data-claim"), g.get("data-device"), g.get("data-pod")): g
             for g in picture.iter(f"{SVG}g") if g.get("class") == "claim"}
    assert set(drawn) == want
    for (claim, device, pod), g in drawn.items():
        text = " ".join(t.text or "" for t in g.iter(f"{SVG}text"))
        assert f"pod {pod}" in text, text
        assert claim in text, text
        assert device in text, text
    lefts = {(g.get("data-owner"), g.get("data-name")): g
             for g in picture.iter(f"{SVG}g") if g.get("class") == "left"}
    for r in (*use.counters, *use.capacity):
        texts = [t.text for t in lefts[(r.owner, r.name)].iter(f"{SVG}text")]
        assert f"left {quantity(r.total - r.used)}" in texts, texts
    assert lefts[(bw.owner, "bandwidth")].get("data-left") == "4G"
    # ... and the CLI writes it, as SVG and as PNG
    for fmt in ("svg", "png"):
        out = tmp_path / f"claims.{fmt}"
        subprocess.run([sys.executable, "-m", "sandbox", "dra", "claims", "--kubeconfig",
                        str(cluster.cp.kubeconfig), "-o", fmt, "--file", str(out)], cwd=REPO,
                       capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    svg = (tmp_path / "claims.svg").read_text()
    assert all(claim in svg and device in svg and pod in svg for claim, device, pod in want)
    assert (tmp_path / "claims.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
