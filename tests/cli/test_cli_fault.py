"""Issue 26, `sandbox fault` through the installed console script on a real local
sandbox and a real `sandbox mount` server: `fault reset` back to the profile's state,
errors said once (no doubled "set-vfs: set-vfs"), a node name checked against the server
behind --socket, set-vfs reporting the VF count, and `mount --daemon` naming a wrong node
itself."""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.cli import _env, console_script, sandbox, state_roots
from tests.support.fakehw_toy import require_fuse

pytestmark = [pytest.mark.root, pytest.mark.fuse]

NODE = "net-worker"  # profiles/sriov-rdma.yaml: nic0 ConnectX-6 Dx with 4 of 8 VFs


@pytest.fixture
def state_root() -> Iterator[Path]:
    yield from state_roots()


@pytest.fixture
def sriov(state_root: Path) -> Iterator[dict[str, str]]:
    """A local sandbox of sriov-rdma; its environment."""
    require_fuse()
    env = _env(state_root)
    up = sandbox("up", "sriov-rdma", "--runtime", "local", env=env)
    assert up.returncode == 0, up.stderr
    yield env
    sandbox("down", env=env)


def _states(env: dict[str, str]) -> dict[str, dict[str, object]]:
    out = sandbox("fault", "list", NODE, "-o", "json", env=env)
    assert out.returncode == 0, out.stderr
    return {d: info["state"] for d, info in json.loads(out.stdout)[NODE].items()}


def test_reset_puts_every_device_back(sriov: dict[str, str]) -> None:
    env = sriov
    before = _states(env)
    said = []
    for args in (["health", NODE, "nic0", "unhealthy", "--reason", "link-down"],
                 ["set-vfs", NODE, "nic0", "6"], ["unplug", NODE, "nic1"],
                 ["health", NODE, "nic2", "unhealthy", "--reason", "removed"]):
        done = sandbox("fault", *args, env=env)
        assert done.returncode == 0, done.stderr
        said.append(done.stdout)
    assert said[1] == f"{NODE}/nic0: unhealthy (link-down), 6 VFs [done]\n"
    changed = _states(env)
    assert changed["nic1"]["plugged"] is False
    assert changed["nic2"]["plugged"] is False
    one = sandbox("fault", "reset", NODE, "nic1", env=env)
    assert one.returncode == 0, one.stderr
    assert one.stdout == f"{NODE}/nic1: healthy [done]\n"
    assert _states(env)["nic0"]["health"] == "unhealthy"  # only nic1
    reset = sandbox("fault", "reset", NODE, env=env)
    assert reset.returncode == 0, reset.stderr
    assert reset.stdout.splitlines() == [f"{NODE}/nic0: healthy, 4 VFs [done]",
                                         f"{NODE}/nic1: healthy [no change]",
                                         f"{NODE}/nic2: healthy [done]"]
    after = _states(env)
    for dev, state in after.items():
        assert (state["health"], state["reason"], state["plugged"]) == \
            (before[dev]["health"], before[dev]["reason"], before[dev]["plugged"]), dev
    # the tree says the profile's 4 VFs again
    status = json.loads(sandbox("status", "-o", "json", env=env).stdout)
    root = Path(json.loads((Path(env["HWSANDBOX_STATE_DIR"]) / "sriov-rdma" / "sandbox.json")
                           .read_text())["nodes"][NODE]["root"])
    assert status["nodes"][0]["name"] == NODE
    numvfs = root / "sys" / "bus" / "pci" / "devices" / "0000:01:00.0" / "sriov_numvfs"
    assert numvfs.read_text() == "4\n"
    wide = sandbox("fault", "list", NODE, "-o", "wide", env=env).stdout.splitlines()
    assert wide[0].split()[-3:] == ["VENDOR", "MODEL", "VFS"], wide[0]
    nic0 = next(line for line in wide if " nic0 " in line)
    assert nic0.split()[-3:] == ["mellanox", "connectx-6dx", "4"], nic0
    status = yaml.safe_load(sandbox("status", "-o", "yaml", env=env).stdout)
    assert status == json.loads(sandbox("status", "-o", "json", env=env).stdout)
    again = sandbox("fault", "reset", NODE, env=env)
    assert all(line.endswith("[no change]") for line in again.stdout.splitlines()), again.stdout
    missing = sandbox("fault", "reset", NODE, "nic9", env=env)
    assert missing.returncode == 1
    assert missing.stderr == f"error: {NODE}: no device 'nic9' (have nic0, nic1, nic2)\n"


def test_reset_needs_the_profile_not_a_socket(tmp_path: Path) -> None:
    out = sandbox("fault", "--socket", str(tmp_path / "x.sock"), "reset", NODE)
    assert out.returncode == 1
    assert out.stderr == ("error: fault reset puts devices back as the sandbox's profile "
                          "starts them; --socket has no profile (use --name)\n")


@pytest.fixture
def mounted() -> Iterator[Path]:
    """A `sandbox mount --daemon` server of sriov-rdma's node; its control socket."""
    require_fuse()
    d = Path(tempfile.mkdtemp(prefix="hwsf-", dir="/tmp"))
    root = d / "root"
    out = sandbox("mount", "sriov-rdma", str(root), "--node", NODE, "--daemon")
    assert out.returncode == 0, out.stderr
    try:
        yield d / "root.sock"
    finally:
        subprocess.run(["fusermount3", "-u", str(root)], check=False, capture_output=True)
        subprocess.run(["rm", "-rf", str(d)], check=False)


def test_errors_are_said_once(mounted: Path) -> None:
    sock = str(mounted)
    too_many = sandbox("fault", "--socket", sock, "set-vfs", NODE, "nic0", "99")
    assert too_many.returncode == 1
    assert too_many.stderr == "error: set-vfs nic0: num_vfs 99 exceeds sriov_totalvfs 8\n"
    unknown = sandbox("fault", "--socket", sock, "unplug", NODE, "gpu7")
    assert unknown.stderr == "error: unplug: unknown device 'gpu7' (have nic0, nic1, nic2)\n"
    vfs = sandbox("fault", "--socket", sock, "set-vfs", NODE, "nic0", "2")
    assert vfs.stdout == f"{NODE}/nic0: healthy, 2 VFs [done]\n", vfs.stderr
    port = sandbox("fault", "--socket", sock, "set-vfs", NODE, "nic0", "3", "--port", "1")
    assert port.stdout == f"{NODE}/nic0: healthy, VFs port 1: 3, other ports: 2 [done]\n"


def test_socket_checks_the_node_it_serves(mounted: Path) -> None:
    wrong = sandbox("fault", "--socket", str(mounted), "health", "bogus-node", "nic0",
                    "unhealthy")
    assert wrong.returncode == 1
    assert wrong.stderr == (f"error: health: node: this server serves node '{NODE}', not "
                            "'bogus-node'\n")
    mislisted = sandbox("fault", "--socket", str(mounted), "list", "bogus-node")
    assert mislisted.returncode == 1
    assert "this server serves node" in mislisted.stderr, mislisted.stderr
    listed = sandbox("fault", "--socket", str(mounted), "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split()[:2] == [NODE, "nic0"]
    state = json.loads(sandbox("fault", "--socket", str(mounted), "list", "-o",
                               "json").stdout)
    assert state[NODE]["nic0"]["state"]["health"] == "healthy"  # nothing was changed


def test_mount_daemon_names_a_wrong_node(tmp_path: Path) -> None:
    out = sandbox("mount", "sriov-rdma", str(tmp_path / "root"), "--node", "sriov-worker",
                  "--daemon")
    assert out.returncode == 1
    assert out.stderr == ("error: sriov-rdma: no node 'sriov-worker' (nodes: net-worker)\n"), \
        out.stderr
    assert not (tmp_path / "root").exists()
    assert console_script().is_file()


def test_a_reason_the_device_cannot_show_is_refused(mounted: Path, tmp_path: Path) -> None:
    """A NIC has no ECC rows and shows nothing of an NVLink: `row-remap-pending` on nic0
    used to be accepted and listed as 'unhealthy (row-remap-pending)' while the tree showed
    aer-fatal's counters. Refused, naming what it can show; the same in a profile."""
    out = sandbox("fault", "--socket", str(mounted), "health", NODE, "nic0", "unhealthy",
                  "--reason", "row-remap-pending")
    assert out.returncode == 1
    assert out.stderr == ("error: health nic0: a mellanox nic cannot show row-remap-pending "
                          "(it shows aer-fatal, link-down, port-down, removed)\n")
    listed = json.loads(sandbox("fault", "--socket", str(mounted), "list", "-o", "json").stdout)
    assert listed[NODE]["nic0"]["state"]["health"] == "healthy"
    ok = sandbox("fault", "--socket", str(mounted), "health", NODE, "nic0", "unhealthy",
                 "--reason", "port-down")
    assert ok.returncode == 0, ok.stderr
    profile = tmp_path / "p.yaml"
    profile.write_text("apiVersion: hwsandbox.dev/v1alpha1\nkind: HardwareProfile\n"
                       "metadata: {name: p}\nnodes:\n  - name: n\n    devices:\n"
                       "      - {type: fpga, vendor: xilinx, model: alveo-u250, "
                       "health: unhealthy, healthReason: port-down}\n")
    bad = sandbox("validate", str(profile))
    assert bad.returncode == 1
    assert (f"{profile}:7:90: nodes[0].devices[0].healthReason: a xilinx fpga cannot show "
            "port-down (it shows aer-fatal, link-down, removed)") in bad.stderr, bad.stderr
