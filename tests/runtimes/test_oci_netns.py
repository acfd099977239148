"""oci-cpumap's plugin-namespace rule: a hostNetwork container annotated
``hwsandbox.dev/netns=plugins`` joins the node's plugin network namespace (the native
runtime's, where sandbox.fakehw.netlinks makes the tree's netdevs real links).

Against the fake runc of test_oci_cpumap.py (what the wrapper hands runc), then in front of
this machine's real runc (the namespace a container is in).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox.errors import SandboxError
from sandbox.runtimes import cpumap
from tests.runtimes.test_oci_cpumap import FAKE_RUNC, HINT, need
from tests.runtimes.test_oci_cpumap_install import real_bundle, run_once

pytestmark = [pytest.mark.root]

NETNS = "/run/hwsb-test/plugins-netns"
PLUGINS = {"hwsandbox.dev/netns": "plugins"}


def _wrap(tmp_path: Path, namespaces: list[dict[str, str]], annotations: dict[str, str],
          netns: str = NETNS) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``create`` through the wrapper in front of the fake runc; the run and its out dir."""
    need("jq")
    fake = tmp_path / "fake-runc"
    fake.write_text(FAKE_RUNC)
    fake.chmod(0o755)
    wrapper = cpumap.install(tmp_path / "bin" / "oci-cpumap", str(fake), netns)
    b = tmp_path / "bundle"
    b.mkdir()
    doc = {"ociVersion": "1.0.2-dev", "root": {"path": "rootfs"},
           "process": {"args": ["/pause"], "cwd": "/"}, "annotations": annotations,
           "linux": {"namespaces": namespaces}}
    (b / "config.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([str(wrapper), "create", "--bundle", str(b), "c1"], capture_output=True,
                          text=True, timeout=30, check=False, stdin=subprocess.DEVNULL,
                          env={**os.environ, "FAKE_RUNC_OUT": str(out),
                               "FAKE_RUNC_CONFIG": str(b / "config.json")})
    return proc, out


def _namespaces(out: Path) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = json.loads((out / "config.json").read_text())["linux"][
        "namespaces"]
    return seen


HOST_NETWORK = [{"type": "pid"}, {"type": "ipc"}, {"type": "mount"}]


def test_an_annotated_host_network_container_joins_the_plugin_namespace(tmp_path: Path) -> None:
    proc, out = _wrap(tmp_path, HOST_NETWORK, PLUGINS)
    assert proc.returncode == 0, proc.stderr
    assert _namespaces(out) == [*HOST_NETWORK, {"type": "network", "path": NETNS}]


@pytest.mark.parametrize(("namespaces", "annotations", "netns"), [
    ([*HOST_NETWORK, {"type": "network", "path": "/var/run/netns/cni-1"}], PLUGINS, NETNS),
    (HOST_NETWORK, {}, NETNS),                                  # not annotated
    (HOST_NETWORK, PLUGINS, ""),                                # no plugin namespace (kind)
], ids=["own-network", "not-annotated", "kind"])
def test_other_containers_keep_their_namespaces(tmp_path: Path, namespaces: list[dict[str, str]],
                                                annotations: dict[str, str], netns: str) -> None:
    proc, out = _wrap(tmp_path, namespaces, annotations, netns)
    assert proc.returncode == 0, proc.stderr
    assert _namespaces(out) == namespaces


def test_another_value_is_refused_and_runc_not_started(tmp_path: Path) -> None:
    proc, out = _wrap(tmp_path, HOST_NETWORK, {"hwsandbox.dev/netns": "/proc/1/ns/net"})
    assert proc.returncode == 1
    assert 'hwsandbox.dev/netns: "/proc/1/ns/net": the only value is "plugins"' in proc.stderr
    assert not (out / "argv").exists()


def test_the_namespace_path_must_be_absolute(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="the plugins' netns must be an absolute path"):
        cpumap.install(tmp_path / "oci-cpumap", "/usr/sbin/runc", "run/netns/x")


@pytest.fixture
def plugin_netns(tmp_path: Path) -> Iterator[Path]:
    """A persistent network namespace (an nsfs bind at a file), unmounted after."""
    ns = tmp_path / "netns"
    ns.touch()
    subprocess.run(["unshare", f"--net={ns}", "true"], check=True)
    try:
        yield ns
    finally:
        subprocess.run(["umount", str(ns)], check=False)


def test_a_real_container_is_in_the_plugin_namespace(tmp_path: Path, plugin_netns: Path) -> None:
    """In front of the real runc: the container's /proc/self/ns/net is the plugin netns."""
    need("jq")
    runc = shutil.which("runc")
    if runc is None:
        pytest.fail(f"runc is not installed: {HINT}")
    b = real_bundle(runc, tmp_path / "bundle", "stat")
    spec = json.loads((b / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = ["/stat", "-L", "-c", "%i", "/proc/self/ns/net"]
    spec["annotations"] = PLUGINS
    spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"]
                                   if n["type"] != "network"]  # hostNetwork
    (b / "config.json").write_text(json.dumps(spec))
    wrapped = cpumap.install(tmp_path / "oci-cpumap", runc, str(plugin_netns))
    proc = run_once(wrapped, runc, b, tmp_path / "state", "hwsb-netns")
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == os.stat(plugin_netns).st_ino
    assert int(proc.stdout) != os.stat("/proc/self/ns/net").st_ino
