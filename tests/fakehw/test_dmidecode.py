"""The SMBIOS tables fool the real inventory readers: ``dmidecode`` and ``lshw``, run where
/sys, /proc and /dev are a node's tree (a private mount namespace; the real ones are never
touched), show the BIOS, system, board, processors and memory devices the profile declares,
and agree with ``dmi/id``. Over every node of every profile, rendered; one node also live
over FUSE. A missing reader FAILS with the apt-get line that installs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.builder._smbios import smbios_tables
from sandbox.fakehw.render import render
from sandbox.profile import load_profile, load_profile_text
from sandbox.profile.spec import NodeSpec
from tests.support.paths import REPO
from tests.support.thirdparty import Bind, in_private_mounts, live_node, require_private_mounts

pytestmark = [pytest.mark.root]

PACKAGES = {"dmidecode": "dmidecode", "lshw": "lshw"}
PROFILES = sorted(REPO.glob("profiles/*.yaml")) + sorted(REPO.glob("tests/data/tree-*.yaml"))
CASES = [
    pytest.param((path, node.name), id=f"{path.stem}/{node.name}")
    for path in PROFILES
    for node in load_profile(path).cluster.nodes
]
UNITS = {"bytes": 1, "kB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: apt-get install -y {PACKAGES[tool]} "
                    "(or scripts/install-system-deps)", pytrace=False)
    return path


def in_tree(root: Path, *argv: str) -> str:
    """``argv``'s output, run with ``root``'s sys, proc and dev over /sys, /proc and /dev;
    fails on a non-zero exit or anything on stderr."""
    require_private_mounts()
    mounts = [Bind(str(root / d), f"/{d}") for d in ("sys", "proc", "dev")]
    proc = subprocess.run(in_private_mounts([need(argv[0]), *argv[1:]], mounts),
                          capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0 or proc.stderr:
        pytest.fail(f"{' '.join(argv)} in {root} exited {proc.returncode}:\n"
                    f"{proc.stderr}{proc.stdout[-2000:]}")
    return proc.stdout



# -- dmidecode --------------------------------------------------------------------------
def dmidecode(root: Path, types: str) -> list[tuple[str, dict[str, str]]]:
    """``dmidecode -t TYPES`` as (structure name, {field: value}) in table order; list
    fields (Characteristics, Flags) keep only their heading."""
    out = in_tree(root, "dmidecode", "-t", types)
    records: list[tuple[str, dict[str, str]]] = []
    for block in out.split("\n\n"):
        lines = block.splitlines()
        if not lines or not lines[0].startswith("Handle 0x"):
            continue
        fields: dict[str, str] = {}
        for line in lines[2:]:
            if line.startswith("\t") and not line.startswith("\t\t"):
                key, _, value = line.strip().partition(":")
                fields[key] = value.strip()
        records.append((lines[1], fields))
    return records


def size(text: str) -> int:
    """dmidecode's ``32 GB`` / ``768 kB`` in bytes."""
    number, unit = text.split()
    return int(number) * UNITS[unit]


def dmi_id(root: Path, name: str) -> str:
    return (root / "sys/devices/virtual/dmi/id" / name).read_text().rstrip("\n")


@pytest.mark.parametrize("rendered", CASES, indirect=True)
def test_dmidecode_identity(rendered: tuple[NodeSpec, Path]) -> None:
    node, root = rendered
    s = node.system
    assert s is not None
    (bios, b), (system, y), (board, m), (chassis, c) = dmidecode(root, "0,1,2,3")
    assert (bios, system, board, chassis) == ("BIOS Information", "System Information",
                                              "Base Board Information", "Chassis Information")
    assert (b["Vendor"], b["Version"], b["Release Date"]) == (s.bios_vendor, s.bios_version,
                                                              s.bios_date)
    assert (y["Manufacturer"], y["Product Name"], y["Version"], y["Serial Number"]) == (
        s.sys_vendor, s.product_name, s.product_version, s.product_serial)
    assert y["UUID"].lower() == s.product_uuid.lower()
    assert (m["Manufacturer"], m["Product Name"], m["Version"], m["Serial Number"]) == (
        s.board_vendor, s.board_name, s.board_version, s.board_serial)
    assert (c["Manufacturer"], c["Serial Number"]) == (s.sys_vendor, s.product_serial)
    # The kernel fills dmi/id from these very structures: both say the same.
    assert {
        "bios_vendor": b["Vendor"], "bios_version": b["Version"], "bios_date": b["Release Date"],
        "bios_release": b["BIOS Revision"], "sys_vendor": y["Manufacturer"],
        "product_name": y["Product Name"], "product_version": y["Version"],
        "product_serial": y["Serial Number"], "product_uuid": y["UUID"].lower(),
        "product_sku": y["SKU Number"], "product_family": y["Family"],
        "board_vendor": m["Manufacturer"], "board_name": m["Product Name"],
        "board_version": m["Version"], "board_serial": m["Serial Number"],
        "board_asset_tag": m["Asset Tag"], "chassis_vendor": c["Manufacturer"],
        "chassis_version": c["Version"], "chassis_serial": c["Serial Number"],
        "chassis_asset_tag": c["Asset Tag"],
    } == {name: dmi_id(root, name) for name in (
        "bios_vendor", "bios_version", "bios_date", "bios_release", "sys_vendor",
        "product_name", "product_version", "product_serial", "product_uuid", "product_sku",
        "product_family", "board_vendor", "board_name", "board_version", "board_serial",
        "board_asset_tag", "chassis_vendor", "chassis_version", "chassis_serial",
        "chassis_asset_tag")}
    assert dmi_id(root, "chassis_type") == str(s.chassis_type)


@pytest.mark.parametrize("rendered", CASES, indirect=True)
def test_dmidecode_processors(rendered: tuple[NodeSpec, Path]) -> None:
    node, root = rendered
    cpu = node.cpu
    procs = [f for name, f in dmidecode(root, "4") if name == "Processor Information"]
    assert [p["Socket Designation"] for p in procs] == [f"CPU{k}" for k in range(cpu.sockets)]
    maker = {"GenuineIntel": "Intel(R) Corporation",
             "AuthenticAMD": "Advanced Micro Devices, Inc."}[cpu.vendor]
    for p in procs:
        assert (p["Version"], p["Manufacturer"], p["Status"]) == (cpu.model, maker,
                                                                  "Populated, Enabled")
        assert (int(p["Core Count"]), int(p["Core Enabled"]), int(p["Thread Count"])) == (
            cpu.cores_per_socket, cpu.cores_per_socket,
            cpu.cores_per_socket * cpu.threads_per_core)
        assert p["Current Speed"] == f"{cpu.mhz} MHz"
        # The CPUID signature says what /proc/cpuinfo says.
        assert p["Signature"].endswith(
            f"Family {cpu.family}, Model {cpu.model_number}, Stepping 8")


def check_memory_devices(node: NodeSpec, root: Path) -> None:
    records = dmidecode(root, "16,17")
    (array_name, array), devices = records[0], [f for _, f in records[1:]]
    assert array_name == "Physical Memory Array"
    assert int(array["Number Of Devices"]) == len(devices) > 0
    per_node: Counter[str] = Counter()
    for d in devices:
        assert d["Size"] == d["Volatile Size"]
        per_node[d["Bank Locator"]] += size(d["Size"])
    assert sum(per_node.values()) == node.memory
    assert per_node == {f"NODE {n.id}": n.memory for n in node.numa}


@pytest.mark.parametrize("rendered", CASES, indirect=True)
def test_dmidecode_memory_devices(rendered: tuple[NodeSpec, Path]) -> None:
    check_memory_devices(*rendered)


def test_dmidecode_memory_below_a_mib(tmp_path: Path) -> None:
    """Three NUMA nodes sharing 10000 MiB get 3333.33 MiB each (whole pages): a last device
    per node holds the part below a MiB, in KB, so the sizes still add up exactly."""
    profile = load_profile_text(
        "apiVersion: hwsandbox.dev/v1alpha1\nkind: HardwareProfile\n"
        "metadata: {name: odd, description: odd memory}\n"
        "nodes:\n  - name: odd\n    cpu: {sockets: 3, coresPerSocket: 2}\n"
        "    memory: 10000Mi\n    numa: {nodes: [{id: 0}, {id: 1}, {id: 2}]}\n")
    node = profile.cluster.nodes[0]
    assert any(n.memory % 2**20 for n in node.numa)
    render(build_tree(node), tmp_path, force=True)
    check_memory_devices(node, tmp_path)


# -- lshw -------------------------------------------------------------------------------
def walk(item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield item
    for child in item.get("children", []):
        yield from walk(child)


@pytest.mark.parametrize("rendered", CASES, indirect=True)
def test_lshw(rendered: tuple[NodeSpec, Path]) -> None:
    node, root = rendered
    s = node.system
    assert s is not None
    top = json.loads(in_tree(root, "lshw", "-json", "-quiet"))
    assert (top["vendor"], top["product"].split(" (")[0], top["serial"]) == (
        s.sys_vendor, s.product_name, s.product_serial)
    nodes = list(walk(top))
    (board,) = [n for n in nodes if n["id"] == "core"]
    assert (board["vendor"], board["product"]) == (s.board_vendor, s.board_name)
    (bios,) = [n for n in nodes if n["id"] == "firmware"]
    assert (bios["vendor"], bios["version"], bios["date"]) == (s.bios_vendor, s.bios_version,
                                                               s.bios_date)
    # (A QAT or other co-processor is a PCI "processor" too, on a pci@ bus.)
    cpus = [n for n in nodes if n["class"] == "processor" and n["businfo"].startswith("cpu@")]
    assert [c["slot"] for c in cpus] == [f"CPU{k}" for k in range(node.cpu.sockets)]
    for c in cpus:
        assert c["product"] == node.cpu.model
        assert (c["configuration"]["cores"], c["configuration"]["threads"]) == (
            str(node.cpu.cores_per_socket),
            str(node.cpu.cores_per_socket * node.cpu.threads_per_core))
    (memory,) = [n for n in nodes if n["id"] == "memory"]
    banks = [n for n in walk(memory) if n["id"].startswith("bank")]
    assert sum(b["size"] for b in banks) == node.memory
    # lshw keeps the banks' sum unless the kernel's own total (sysinfo(2), which no tree
    # can change) is larger: then it shows this host's memory.
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory["size"] == (node.memory if node.memory > host else memory["size"])


# -- the tables themselves and a live mount ---------------------------------------------
@pytest.mark.parametrize("rendered", CASES[:1], indirect=True)
def test_entry_point_and_table(rendered: tuple[NodeSpec, Path]) -> None:
    """The 64-bit entry point (DSP0134 5.2.2) checksums to 0 and gives the table's exact
    length; the table ends with the End-of-Table structure, as the kernel cuts it."""
    node, root = rendered
    tables = root / "sys/firmware/dmi/tables"
    entry, table = (tables / "smbios_entry_point").read_bytes(), (tables / "DMI").read_bytes()
    assert (entry, table) == smbios_tables(node)
    assert entry[:5] == b"_SM3_"
    assert entry[6] == len(entry) == 0x18
    assert sum(entry) % 256 == 0
    assert int.from_bytes(entry[12:16], "little") == len(table)
    assert table.endswith(b"\x7f\x04" + table[-4:-2] + b"\0\0")
    assert oct((tables / "DMI").stat().st_mode & 0o777) == "0o400"


def inventory(lshw_json: str) -> list[tuple[str, str, str, int]]:
    """(id, vendor, product, size) of lshw's system, board, firmware, CPUs and memory."""
    return [(n["id"], n.get("vendor", ""), n.get("product", ""), n.get("size", 0))
            for n in walk(json.loads(lshw_json))
            if n["class"] in ("system", "processor", "memory") or n["id"] == "core"]


@pytest.mark.fuse
def test_live_mount_reads_the_same(tmp_path: Path) -> None:
    """Over the live FUSE mount, dmidecode and lshw print what they print on the render."""
    path = REPO / "profiles/sriov-rdma.yaml"
    node = load_profile(path).cluster.nodes[0]
    render(build_tree(node), tmp_path, force=True)
    with live_node(path.name, node.name) as live:
        dmi = in_tree(live.root, "dmidecode")
        hw = in_tree(live.root, "lshw", "-json", "-quiet")
    assert node.system is not None
    assert f"Product Name: {node.system.product_name}\n" in dmi
    assert dmi == in_tree(tmp_path, "dmidecode")
    assert inventory(hw) == inventory(in_tree(tmp_path, "lshw", "-json", "-quiet"))
