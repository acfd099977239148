"""Real links for the tree's netdevs (``sandbox.fakehw.netlinks``): ``ip -j link`` (iproute2,
unmodified) in the node's network namespace lists what the live tree's ``sys/class/net``
shows — names, addresses, MTU, ifindex — and follows faults (link-down: operstate down)
and ``set-vfs`` (VF links made and removed); stopping the process removes every link; the
host's own namespace is refused. Every expected value is read from the served tree.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox.fakehw.control import ControlClient
from sandbox.fakehw.netlinks import is_host_netns, tree_links
from tests.support.paths import REPO
from tests.support.thirdparty import LiveNode, live_node

pytestmark = [pytest.mark.root]


def require_ip() -> None:
    if shutil.which("ip") is None:
        pytest.fail("iproute2's ip is needed: apt-get install iproute2", pytrace=False)
    if os.geteuid() != 0:
        pytest.fail("making network namespaces and links needs root", pytrace=False)


@pytest.fixture(scope="module")
def node() -> Iterator[LiveNode]:
    with live_node("sriov-rdma.yaml", "net-worker") as live:
        yield live


@pytest.fixture
def netns() -> Iterator[str]:
    require_ip()
    name = f"hwsb-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def ip_links(ns: str) -> dict[str, dict[str, Any]]:
    out = subprocess.run(["ip", "-n", ns, "-j", "link", "show"], capture_output=True,
                         text=True, check=True).stdout
    return {link["ifname"]: link for link in json.loads(out) if link["ifname"] != "lo"}


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def agree(root: Path, ns: str) -> bool:
    """Whether the namespace's links are exactly the tree's netdevs, as it shows them."""
    want, have = tree_links(root), ip_links(ns)
    if set(want) != set(have):
        return False
    for name, link in want.items():
        got = have[name]
        if got["mtu"] != link.mtu or got["ifindex"] != link.ifindex:
            return False
        if link.address is not None and got["address"] != link.address.hex(":"):
            return False
        if got["operstate"] != ("UP" if link.carrier else "DOWN"):
            return False
        if "UP" not in got["flags"]:
            return False
    return True


@pytest.fixture
def links(node: LiveNode, netns: str, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    log = tmp_path / "netlinks.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox.fakehw.netlinks", "--root", str(node.root),
             "--control", str(node.control), "--netns", f"/run/netns/{netns}", "-v"],
            cwd=REPO, stderr=out)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        print(log.read_text())  # shown with a failure


def test_links_follow_the_tree_through_faults_and_set_vfs(
        node: LiveNode, netns: str, links: subprocess.Popen[bytes]) -> None:
    wait_for(lambda: agree(node.root, netns), "the links to match the tree")
    assert len(ip_links(netns)) == len(tree_links(node.root)) > 4
    with ControlClient(node.control) as c:
        c.health("nic0", "unhealthy", "link-down")
        wait_for(lambda: agree(node.root, netns), "link-down to reach the links")
        down = {n for n, link in ip_links(netns).items() if link["operstate"] == "DOWN"}
        assert down
        assert down == {n for n, link in tree_links(node.root).items() if not link.carrier}
        c.health("nic0", "healthy")
        wait_for(lambda: agree(node.root, netns), "recovery to reach the links")
        before = set(ip_links(netns))
        c.set_vfs("nic0", 0)
        wait_for(lambda: agree(node.root, netns), "set-vfs 0 to reach the links")
        assert set(ip_links(netns)) < before
        c.set_vfs("nic0", 4)
        wait_for(lambda: agree(node.root, netns), "set-vfs 4 to reach the links")
        assert set(ip_links(netns)) == before
    links.send_signal(signal.SIGTERM)
    assert links.wait(timeout=10) == 0
    assert ip_links(netns) == {}, "the links outlive the process"


def test_the_hosts_own_namespace_is_refused(node: LiveNode) -> None:
    require_ip()
    if not is_host_netns("/proc/self/ns/net"):
        pytest.fail("run this test in the host's own network namespace (it checks that "
                    "the links are never made there)", pytrace=False)
    result = subprocess.run(
        [sys.executable, "-m", "sandbox.fakehw.netlinks", "--root", str(node.root),
         "--netns", "/proc/self/ns/net"],
        cwd=REPO, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 1
    assert "refusing the host's own network namespace" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_link_the_kernel_refuses_costs_no_other(node: LiveNode, netns: str,
                                                  tmp_path: Path) -> None:
    """A name already taken in the namespace by a link of another kind (here a veth): that
    one is left alone and said, every other netdev still gets its link."""
    want = tree_links(node.root)
    taken = sorted(want)[0]
    subprocess.run(["ip", "-n", netns, "link", "add", taken, "type", "veth", "peer", "name",
                    "hwsbpeer"], check=True)
    log = tmp_path / "netlinks.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox.fakehw.netlinks", "--root", str(node.root),
             "--netns", f"/run/netns/{netns}"], cwd=REPO, stderr=out)
    try:
        def others_made() -> bool:
            have = ip_links(netns)
            return all(name in have and (link.address is None
                                         or have[name]["address"] == link.address.hex(":"))
                       for name, link in want.items() if name != taken)
        wait_for(others_made, "the other links")
        wait_for(lambda: f"{taken}: " in log.read_text(), "the refusal in the log")
        assert ip_links(netns)[taken].get("link_type") == "ether"
        assert proc.poll() is None, log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
