"""`sandbox up`'s runtime options refused before anything runs: feature gates and the DRA
driver's options (``--dra-*``) of the native runtime.

Each case runs the real CLI (``python -m sandbox up PROFILE …``) in a fresh state dir and
expects a short error on stderr (argparse's usage line plus one error line for bad
syntax, exactly one ``error:`` line for a refused combination), no traceback and no state
created. The refusals come before the runtime's own checks, so they need neither root nor
the Kubernetes binaries.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

pytestmark = [pytest.mark.root]

MIG_PROFILE = REPO / "profiles" / "mig-partitions.yaml"
SRIOV_PROFILE = REPO / "profiles" / "sriov-rdma.yaml"
NATIVE = ["--runtime", "native"]


def _up(tmp_path: Path, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HWSANDBOX_STATE_DIR=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "sandbox", "up", str(profile), *args],
                          capture_output=True, text=True, timeout=60, check=False, env=env,
                          cwd=REPO)  # fmt: skip


@pytest.mark.parametrize(("profile", "args", "message"), [
    # bad syntax: argparse's usage line, then its error
    (MIG_PROFILE, [*NATIVE, "--feature-gates", "DRAPartitionableDevices"],
     "is not NAME=true or NAME=false"),
    (MIG_PROFILE, [*NATIVE, "--feature-gates", "A=yes"], "is not NAME=true or NAME=false"),
    (SRIOV_PROFILE, [*NATIVE, "--feature-gates", "DRAOptionalNodeOperations=true",
                     "--dra-skip-node-operations", "vf,sriov"],
     "sriov: not a device type (one or more of gpu, gpu-partition, nic, vf, fpga"),
    (SRIOV_PROFILE, [*NATIVE, "--dra-skip-node-operations", ","], "not a device type"),
])  # fmt: skip
def test_up_refuses_bad_syntax(tmp_path: Path, profile: Path, args: list[str],
                               message: str) -> None:
    proc = _up(tmp_path, profile, *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("usage: sandbox up"), proc.stderr
    assert lines[-1].startswith("sandbox up: error: argument "), proc.stderr
    assert message in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == [], "a refused up created state"


@pytest.mark.parametrize(("profile", "args", "message"), [
    (MIG_PROFILE, ["--runtime", "local", "--feature-gates", "DRAConsumableCapacity=true"],
     "--feature-gates needs --runtime native (not local"),
    (MIG_PROFILE, ["--feature-gates", "DRAConsumableCapacity=true"],
     "--feature-gates needs --runtime native (not auto"),
    (MIG_PROFILE, ["--runtime", "local", "--dra-driver"],
     "the --dra-* options need --runtime native (not local"),
    (MIG_PROFILE, ["--runtime", "local", "--no-device-plugin"],
     "--no-device-plugin needs the kind or native runtime (the local runtime is our device "
     "plugin and a kubelet harness"),
    # an alpha driver option without its gate: the API server would drop the fields
    (MIG_PROFILE, [*NATIVE, "--dra-compatibility-groups"],
     "--dra-compatibility-groups needs the DRADeviceCompatibilityGroups feature gate: "
     "add --feature-gates DRADeviceCompatibilityGroups=true"),
    (MIG_PROFILE, [*NATIVE, "--feature-gates", "DRADeviceCompatibilityGroups=false",
                   "--dra-compatibility-groups"],
     "--dra-compatibility-groups needs the DRADeviceCompatibilityGroups feature gate"),
    (SRIOV_PROFILE, [*NATIVE, "--feature-gates", "DRADeviceCompatibilityGroups=true",
                     "--dra-skip-node-operations", "vf"],
     "--dra-skip-node-operations needs the DRAOptionalNodeOperations feature gate: "
     "add --feature-gates DRAOptionalNodeOperations=true"),
    (MIG_PROFILE, ["--runtime", "local", "--pre-start-required"],
     "--pre-start-required is for the reference device plugin on a real kubelet"),
    (MIG_PROFILE, [*NATIVE, "--no-device-plugin", "--pre-start-required"],
     "without --no-device-plugin"),
])  # fmt: skip
def test_up_refuses_options_without_their_runtime_or_gate(
        tmp_path: Path, profile: Path, args: list[str], message: str) -> None:
    proc = _up(tmp_path, profile, *args)
    assert proc.returncode == 1, proc.stderr
    [line] = proc.stderr.strip().splitlines()  # one line: no progress, no usage dump
    assert line.startswith("error: "), proc.stderr
    assert message in line, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == [], "a refused up created state"
