"""oci-cpumap's device rule: a container's device entry keeps its numbers only when the node
has a device of that type and those numbers at the same path (or it is one of the five
harmless memory devices); anything else, such as the explicit MIG numbers of NVIDIA's DRA
driver's CDI specs, becomes a stand-in char 1:3, and so do the cgroup allow rules for it.

Against the fake runc of test_oci_cpumap.py (what the wrapper hands runc), then in front of
this machine's real runc (what a container sees).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sandbox.runtimes import cpumap
from tests.runtimes.test_oci_cpumap import FAKE_RUNC, HINT, need
from tests.runtimes.test_oci_cpumap_install import real_bundle, run_once

pytestmark = [pytest.mark.root]

ANNOTATION = "hwsandbox.dev/stand-in-devices"


def _dev(path: str, kind: str, major: int, minor: int, **extra: Any) -> dict[str, Any]:
    return {"path": path, "type": kind, "major": major, "minor": minor, **extra}


def _rule(kind: str | None, major: int | None, minor: int | None) -> dict[str, Any]:
    rule: dict[str, Any] = {"allow": True, "access": "rwm"}
    if kind is not None:
        rule |= {"type": kind, "major": major, "minor": minor}
    return rule


def _wrap(tmp_path: Path, devices: list[dict[str, Any]],
          rules: list[dict[str, Any]]) -> tuple[dict[str, Any], Path]:
    """Run ``create`` through the wrapper in front of the fake runc; the config runc got."""
    need("jq")
    fake = tmp_path / "fake-runc"
    fake.write_text(FAKE_RUNC)
    fake.chmod(0o755)
    wrapper = cpumap.install(tmp_path / "bin" / "oci-cpumap", str(fake))
    b = tmp_path / "bundle"
    b.mkdir()
    doc = {"ociVersion": "1.0.2-dev", "root": {"path": "rootfs"},
           "process": {"args": ["/pause"], "cwd": "/"},
           "linux": {"devices": devices, "resources": {"devices": rules}}}
    (b / "config.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([str(wrapper), "create", "--bundle", str(b), "c1"], capture_output=True,
                          text=True, timeout=30, check=False, stdin=subprocess.DEVNULL,
                          env={**os.environ, "FAKE_RUNC_OUT": str(out),
                               "FAKE_RUNC_CONFIG": str(b / "config.json")})
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "config.json").read_text()), b / "config.json"


def test_a_profiles_numbers_become_a_stand_in_and_real_nodes_stay(tmp_path: Path) -> None:
    if not Path("/dev/fuse").is_char_device():
        pytest.fail("/dev/fuse is missing: this test compares with a real device node there")
    fuse = os.stat("/dev/fuse").st_rdev
    fuse_numbers = (os.major(fuse), os.minor(fuse))
    not_a_device = tmp_path / "plain-file"
    not_a_device.write_text("x")
    devices = [
        _dev("/dev/nvidia-caps/nvidia-cap21", "c", 237, 21, fileMode=0o444),  # CDI's explicit
        _dev("/dev/fuse", "c", *fuse_numbers),             # the node's own: kept
        _dev("/dev/zero", "c", 1, 5),                      # harmless: kept
        _dev("/dev/fuse", "b", *fuse_numbers),             # wrong type for that path
        _dev("/dev/null", "c", 4, 64),                     # the path is real, the numbers not
        _dev(str(not_a_device), "c", 195, 0),              # a file, not a device
        _dev("/dev/no-such-node", "b", 8, 0),              # absent on the node
    ]
    rules = [{"allow": False, "access": "rwm"}, _rule("c", 237, 21), _rule("c", *fuse_numbers),
             _rule("b", 8, 0), _rule("c", 4, 64), _rule("c", 195, 0), _rule(None, None, None)]
    seen, _ = _wrap(tmp_path, devices, rules)
    got = [(d["path"], d["type"], d["major"], d["minor"]) for d in seen["linux"]["devices"]]
    assert got == [
        ("/dev/nvidia-caps/nvidia-cap21", "c", 1, 3),
        ("/dev/fuse", "c", *fuse_numbers),
        ("/dev/zero", "c", 1, 5),
        ("/dev/fuse", "c", 1, 3),
        ("/dev/null", "c", 1, 3),
        (str(not_a_device), "c", 1, 3),
        ("/dev/no-such-node", "c", 1, 3),
    ]
    assert seen["linux"]["devices"][0]["fileMode"] == 0o444  # only the numbers change
    got_rules = [(r.get("type"), r.get("major"), r.get("minor"))
                 for r in seen["linux"]["resources"]["devices"]]
    # fuse's rule stays: a kept entry has those numbers (the wrong-type one is block)
    assert got_rules == [(None, None, None), ("c", 1, 3), ("c", *fuse_numbers), ("c", 1, 3),
                         ("c", 1, 3), ("c", 1, 3), (None, None, None)]
    assert seen["annotations"][ANNOTATION].split(",") == [
        "/dev/nvidia-caps/nvidia-cap21=c:237:21", f"/dev/fuse=b:{fuse_numbers[0]}:"
        f"{fuse_numbers[1]}", "/dev/null=c:4:64", f"{not_a_device}=c:195:0",
        "/dev/no-such-node=b:8:0"]


def test_a_config_whose_devices_are_all_real_is_not_rewritten(tmp_path: Path) -> None:
    devices = [_dev("/dev/null", "c", 1, 3), _dev("/dev/zero", "c", 1, 5)]
    seen, config = _wrap(tmp_path, devices, [_rule("c", 1, 3)])
    assert seen == json.loads(config.read_text())
    assert "annotations" not in seen


def test_a_container_gets_dev_nulls_numbers_for_a_profiles_node(tmp_path: Path) -> None:
    """In front of the real runc: the container's node is char 1:3, never 237:21."""
    need("jq")
    runc = shutil.which("runc")
    if runc is None:
        pytest.fail(f"runc is not installed: {HINT}")
    if os.geteuid() != 0:
        pytest.fail("this test starts a real container: it needs root")
    b = real_bundle(runc, tmp_path / "bundle", "stat")
    spec = json.loads((b / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = ["/stat", "-c", "%F %t:%T", "/dev/nvidia-cap21"]
    spec["linux"]["devices"] = [_dev("/dev/nvidia-cap21", "c", 237, 21, fileMode=0o444,
                                     uid=0, gid=0)]
    spec["linux"].setdefault("resources", {})["devices"] = [
        {"allow": False, "access": "rwm"}, _rule("c", 237, 21)]
    (b / "config.json").write_text(json.dumps(spec))
    wrapped = cpumap.install(tmp_path / "oci-cpumap", runc)
    proc = run_once(wrapped, runc, b, tmp_path / "state", "hwsb-devices")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "character special file 1:3"
