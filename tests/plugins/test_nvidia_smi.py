"""Our nvidia-smi (sandbox/nvml/smi, docs/nvml.md) run as a program against node trees: its
``-L``, ``-q`` and ``--query-gpu`` CSV say what the profile says, its MIG listing what the
state file says, and after faults on a live node (health, a lost GPU, unplug) what NVML says
in this process; its errors and exit codes; and the driver root ``python -m sandbox.nvml
--driver-root`` lays out, whose nvidia-smi finds its library by itself.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.nvml.build import SMI_NAME
from tests.plugins.test_nvidia_plugin import tree_gpus
from tests.plugins.test_nvml import rendered
from tests.support import nvml_ctypes as N
from tests.support.nvidia import nvml_library
from tests.support.paths import REPO
from tests.support.thirdparty import live_node

pytestmark = [pytest.mark.root, pytest.mark.fuse]

NAME = "NVIDIA H100 80GB HBM3"
CSV = "index,uuid,name,pci.bus_id,memory.total,driver_version,numa.node,minor_number"


def smi(root: Path, *args: str, program: Path | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run nvidia-smi (ours, from the cache unless ``program``) against the tree at root."""
    program = program or nvml_library().with_name(SMI_NAME)
    full = {"PATH": os.environ["PATH"], "HWSANDBOX_NVML_ROOT": str(root),
            "HWSANDBOX_NVML_REFRESH_MS": "0", **(env or {})}  # fmt: skip
    return subprocess.run([str(program), *args], capture_output=True, text=True, env=full,
                          timeout=60)  # fmt: skip


def ok(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout.splitlines()


def driver_version(root: Path) -> str:
    match = re.search(r"Kernel Module\s+(\S+)", (root / "proc/driver/nvidia/version").read_text())
    assert match
    return match.group(1)


def expected_rows(root: Path) -> list[str]:
    """``--query-gpu=CSV --format=csv,noheader,nounits`` from the tree: GPUs by bus id."""
    version = driver_version(root)
    gpus = sorted(tree_gpus(root).values(), key=lambda g: g.bdf)
    return [f"{i}, {g.uuid}, {NAME}, 0000{g.bdf.upper()}, 81920, {version}, {g.numa_node}, "
            f"{g.minor}" for i, g in enumerate(gpus)]  # fmt: skip


def report_blocks(lines: list[str]) -> dict[str, dict[str, str]]:
    """``-q`` output -> {bus id: {label: value}} (nested labels flattened)."""
    blocks: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in lines:
        if line.startswith("GPU "):
            current = blocks.setdefault(line[4:], {})
        elif ":" in line:
            label, value = (part.strip() for part in line.split(":", 1))
            current.setdefault(label, value)
    return blocks


def test_list_query_and_report_say_what_the_profile_says(tmp_path: Path) -> None:
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    gpus = sorted(tree_gpus(root).values(), key=lambda g: g.bdf)
    assert len(gpus) == 8
    assert ok(smi(root, "-L")) == [f"GPU {i}: {NAME} (UUID: {g.uuid})"
                                   for i, g in enumerate(gpus)]  # fmt: skip
    assert ok(smi(root, f"--query-gpu={CSV}", "--format=csv,noheader,nounits")) == \
        expected_rows(root)
    header, *rows = ok(smi(root, "--query-gpu=index,name,memory.total", "--format=csv"))
    assert header == "index, name, memory.total [MiB]"
    assert rows == [f"{i}, {NAME}, 81920 MiB" for i in range(8)]

    lines = ok(smi(root, "-q"))
    assert lines[:3] == [f"Driver Version                      : {driver_version(root)}",
                         "CUDA Version                        : 12.4",
                         "Attached GPUs                       : 8"]  # fmt: skip
    blocks = report_blocks(lines)
    assert list(blocks) == [f"0000{g.bdf.upper()}" for g in gpus]
    for i, g in enumerate(gpus):
        block = blocks[f"0000{g.bdf.upper()}"]
        assert (block["Index"], block["Product Name"], block["GPU UUID"]) == (str(i), NAME, g.uuid)
        assert (block["Minor Number"], block["NUMA Node"]) == (str(g.minor), str(g.numa_node))
        assert (block["Total"], block["MIG Mode Current"]) == ("81920 MiB", "Disabled")
        assert block["Device Id"] == "0x233010DE"

    # no option: a table, one row per GPU
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in ok(smi(root)) if line.startswith("|")][1:]  # fmt: skip
    assert rows == [[str(i), NAME, f"0000{g.bdf.upper()}", "0 / 81920 MiB", str(g.numa_node),
                     "Disabled"] for i, g in enumerate(gpus)]  # fmt: skip

    # -i: by index, by UUID, by PCI bus id (either domain width), several at once
    only = ["--query-gpu=index", "--format=csv,noheader"]
    assert ok(smi(root, "-i", "3", *only)) == ["3"]
    assert ok(smi(root, "-i", gpus[5].uuid, *only)) == ["5"]
    assert ok(smi(root, "-i", f"0000{gpus[4].bdf}", *only)) == ["4"]
    assert ok(smi(root, f"--id={gpus[6].bdf},1", *only)) == ["6", "1"]
    assert ok(smi(root, "-i", "2", "-L")) == [f"GPU 2: {NAME} (UUID: {gpus[2].uuid})"]


def test_mig_listing_says_what_the_state_file_says(tmp_path: Path) -> None:
    root = rendered("mig-partitions.yaml", tmp_path / "root")
    migs = [dict(kv.split("=", 1) for kv in line.split()[2:]) | {"bdf": line.split()[1]}
            for line in (root / "proc/driver/nvidia/hwsandbox/nvml").read_text().splitlines()
            if line.startswith("mig ")]  # fmt: skip
    index = {bdf: i for i, bdf in enumerate(sorted({m["bdf"] for m in migs}))}
    assert len(index) == 4
    assert len(migs) == 16

    listed = ok(smi(root, "-L"))
    mig_lines = [line for line in listed if line.startswith("  MIG ")]
    assert [line.rsplit("UUID: ", 1)[1].rstrip(")") for line in mig_lines] == \
        [m["uuid"] for m in migs]  # fmt: skip
    assert [line.split()[1] for line in mig_lines] == [m["name"] for m in migs]
    assert len(listed) == 4 + 16

    header, *rows = ok(smi(root, "mig", "-lgi"))
    assert header.split() == ["GPU", "Name", "Profile", "GI", "ID", "Placement"]
    assert sorted(tuple(row.split()) for row in rows) == sorted(
        (str(index[m["bdf"]]), m["name"], m["profile"], m["gi"], f"{m['start']}:{m['size']}")
        for m in migs)
    header, *rows = ok(smi(root, "mig", "-lci"))
    assert sorted(tuple(row.split()[:5]) for row in rows) == sorted(
        (str(index[m["bdf"]]), m["gi"], m["name"], m["ci-profile"], m["ci"]) for m in migs)

    blocks = report_blocks(ok(smi(root, "-q", "-i", "0")))
    block = next(iter(blocks.values()))
    assert (block["MIG Mode Current"], block["MIG Mode Pending"]) == ("Enabled", "Enabled")
    assert block["UUID"] == migs[0]["uuid"]  # the first MIG device's
    assert ok(smi(root, "--query-gpu=mig.mode.current", "--format=csv,noheader")) == \
        ["Enabled"] * 4
    # a GPU without MIG: no instances to list, said on stderr
    plain = rendered("8gpu-2numa.yaml", tmp_path / "plain")
    result = smi(plain, "mig", "-lgi")
    assert (result.returncode, result.stdout.count("\n")) == (0, 1)
    assert "No GPU instances" in result.stderr


def nvml_view(nvml: N.Nvml, root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[
        list[str], list[int]]:  # fmt: skip
    """What NVML in this process says of the tree now, as nvidia-smi would print it: the
    ``--query-gpu`` rows of the GPUs it can reach, and the indices of those it cannot (lost)."""
    monkeypatch.setenv("HWSANDBOX_NVML_ROOT", str(root))
    nvml.check(nvml.nvmlInit_v2())
    try:
        buf = ctypes.create_string_buffer(80)
        nvml.check(nvml.nvmlSystemGetDriverVersion(buf, 80))
        rows, lost = [], []
        for i in range(nvml.count()):
            h = ctypes.c_void_p()
            ret = nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h))
            if ret == N.GPU_IS_LOST:
                lost.append(i)
                continue
            nvml.check(ret)
            ret, total = nvml.memory(h)
            nvml.check(ret)
            rows.append(", ".join(map(str, (
                i, nvml.uuid(h), nvml.text("nvmlDeviceGetName", h), nvml.pci(h).busId.decode(),
                total >> 20, buf.value.decode(), nvml.uint("nvmlDeviceGetNumaNodeId", h),
                nvml.uint("nvmlDeviceGetMinorNumber", h)))))
        return rows, lost
    finally:
        nvml.check(nvml.nvmlShutdown())


def test_after_faults_it_says_what_nvml_says(nvml: N.Nvml,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    with live_node("8gpu-2numa.yaml", "gpu-worker") as live:
        with live.client() as client:
            devices = client.devices()
        bus = {name: f"0000{devices[name]['pci_address'].upper()}"
               for name in ("gpu3", "gpu5", "gpu6")}  # fmt: skip

        def agree() -> tuple[subprocess.CompletedProcess[str], list[str], list[int]]:
            result = smi(live.root, f"--query-gpu={CSV}", "--format=csv,noheader,nounits")
            rows, lost = nvml_view(nvml, live.root, monkeypatch)
            assert result.stdout.splitlines() == rows
            assert [int(i) for i in re.findall(r"^nvidia-smi: GPU (\d+): GPU is lost$",
                                               result.stderr, re.M)] == lost  # fmt: skip
            assert result.returncode == (N.GPU_IS_LOST if lost else 0), result.stderr
            return result, rows, lost

        _, before, _ = agree()
        assert before == expected_rows(live.root)

        with live.client() as client:  # an Xid: the GPU still answers
            client.health("gpu3", "unhealthy", "aer-fatal")
        _, rows, lost = agree()
        assert (rows, lost) == (before, [])

        # a GPU gone from the bus: a new process's NVML (nvidia-smi's, this one's after
        # nvmlInit) no longer has it; only a process that had it sees it lost (test_nvml)
        with live.client() as client:
            client.health("gpu5", "unhealthy", "removed")
        _, rows, lost = agree()
        assert lost == []
        assert len(rows) == 7
        assert not any(bus["gpu5"] in row for row in rows)
        assert len(ok(smi(live.root, "-L"))) == 7

        with live.client() as client:  # unplugged: the same
            client.unplug("gpu6")
        _, rows, lost = agree()
        assert lost == []
        assert len(rows) == 6
        assert not any(bus["gpu6"] in row or bus["gpu5"] in row for row in rows)
        assert ok(smi(live.root, "--query-gpu=count", "--format=csv,noheader")) == ["6"] * 6

        with live.client() as client:
            client.plug("gpu6")
            client.plug("gpu5")  # back on the bus, healthy
            client.health("gpu3", "healthy")
        assert agree()[1] == before


def test_errors_and_exit_codes(tmp_path: Path) -> None:
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (empty, ("-L",), N.DRIVER_NOT_LOADED, "NVML could not start: Driver Not Loaded"),
        (root, ("--query-gpu=index,fan.speed", "--format=csv"), 2, '"fan.speed" is not a field'),
        (root, ("--query-gpu=index", "--format=xml"), 2, 'unknown --format option "xml"'),
        (root, ("--query-gpu=index",), 2, "needs --format=csv"),
        (root, ("-i", "8", "-L"), N.NOT_FOUND, "no GPU with index 8 (8 GPUs)"),
        (root, ("-i", "GPU-00000000-0000-0000-0000-000000000000", "-L"), N.NOT_FOUND, "no GPU"),
        (root, ("--bogus",), 2, "unknown argument --bogus"),
        (root, ("-L", "-q"), 2, "usage: nvidia-smi"),
        (root, ("mig", "-cgi"), 2, "lists only"),
    ]
    for tree, args, code, message in cases:
        result = smi(tree, *args)
        assert (result.returncode, result.stdout) == (code, ""), (args, result)
        assert message in result.stderr, (args, result.stderr)
    assert "--query-gpu" in ok(smi(root, "--help"))[0]
    assert "memory.total" in "\n".join(ok(smi(root, "--help-query-gpu")))


def test_driver_root(tmp_path: Path) -> None:
    root = rendered("8gpu-2numa.yaml", tmp_path / "node")
    version = driver_version(root)
    dest = tmp_path / "driver"

    def make(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sandbox.nvml", "--driver-root", *args],
                              capture_output=True, text=True, cwd=REPO, timeout=300)  # fmt: skip

    for _ in range(2):  # idempotent
        result = make(str(dest), "--node-root", str(root))
        assert (result.returncode, result.stdout.strip()) == (0, str(dest)), result.stderr
    libdir = dest / "usr/lib" / {"aarch64": "aarch64-linux-gnu"}.get(os.uname().machine,
                                                                     "x86_64-linux-gnu")
    versioned = libdir / f"libnvidia-ml.so.{version}"
    assert versioned.is_file()
    assert not versioned.is_symlink()
    assert versioned.read_bytes() == nvml_library().read_bytes()
    assert os.readlink(libdir / "libnvidia-ml.so.1") == versioned.name
    assert os.readlink(libdir / "libnvidia-ml.so") == "libnvidia-ml.so.1"
    program = dest / "usr/bin/nvidia-smi"
    assert os.access(program, os.X_OK)
    # no LD_LIBRARY_PATH: it finds the driver root's library by its RUNPATH
    ldd = subprocess.run(["ldd", str(program)], capture_output=True, text=True, check=True,
                         env={"PATH": os.environ["PATH"]})  # fmt: skip
    found = re.search(r"libnvidia-ml.so.1 => (\S+)", ldd.stdout)
    assert found, ldd.stdout
    assert Path(found.group(1)).resolve() == versioned, ldd.stdout
    assert ok(smi(root, f"--query-gpu={CSV}", "--format=csv,noheader,nounits",
                  program=program)) == expected_rows(root)  # fmt: skip

    foreign = tmp_path / "foreign"
    (foreign / "usr/bin").mkdir(parents=True)
    for args, message in (
        ((str(foreign), "--driver-version", version), "not a driver root of ours"),
        (("/usr/local", "--driver-version", version), "below) the host's /usr"),
        ((str(tmp_path / "new"), "--driver-version", "1/../2"), "is not a driver version"),
        ((str(tmp_path / "new"), "--node-root", str(tmp_path)), "no NVIDIA GPUs' state file"),
    ):
        result = make(*args)
        assert result.returncode == 1, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in foreign.rglob("*")) == ["bin", "usr"]
