"""Run the real third-party readers (hwloc, lscpu, numactl, lspci, ibstat) against a fake root.

Each helper returns the reader's output parsed into plain data. A missing reader makes the
calling test FAIL with the apt-get line that installs it: these tests never skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGES = {
    "chattr": "e2fsprogs",
    "lstopo-no-graphics": "hwloc-nox",
    "lscpu": "util-linux",
    "unshare": "util-linux",
    "numactl": "numactl",
    "lspci": "pciutils",
    "ibstat": "infiniband-diags",
}


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: apt-get install -y {PACKAGES[tool]}")
    return path


def run(argv: list[str], env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr}{proc.stdout}")
    return proc.stdout


# -- hwloc ------------------------------------------------------------------------------
def lstopo(root: Path, *extra: str) -> ET.Element:
    """hwloc's XML for ``root``; -x86 keeps the host's CPUID out of the result."""
    env = {**os.environ, "HWLOC_FSROOT": str(root), "HWLOC_COMPONENTS": "-x86"}
    out = run([need("lstopo-no-graphics"), "--of", "xml", *extra, "-"], env)
    return ET.fromstring(out)


def hwloc_mask(text: str) -> set[int]:
    """hwloc's ``0x0000ffff,0x0000ffff`` cpuset/nodeset as a set of indexes."""
    value = int(text.replace("0x", "").replace(",", ""), 16)
    return {i for i in range(value.bit_length()) if value >> i & 1}


def parents(root: ET.Element) -> dict[ET.Element, ET.Element]:
    return {child: parent for parent in root.iter() for child in parent}


# -- lscpu ------------------------------------------------------------------------------
def lscpu(root: Path) -> dict[str, str]:
    """``lscpu --sysroot ROOT -J`` flattened to {field without colon: data}."""
    data = json.loads(run([need("lscpu"), "--sysroot", str(root), "-J"]))
    out: dict[str, str] = {}

    def walk(items: list[dict[str, object]]) -> None:
        for item in items:
            out[str(item["field"]).rstrip(":")] = str(item.get("data", ""))
            children = item.get("children")
            if isinstance(children, list):
                walk(children)

    walk(data["lscpu"])
    return out


# -- numactl ----------------------------------------------------------------------------
@dataclass
class NumaHardware:
    nodes: list[int] = field(default_factory=list)
    cpus: dict[int, list[int]] = field(default_factory=dict)
    size_mb: dict[int, int] = field(default_factory=dict)
    distances: list[list[int]] = field(default_factory=list)


def numactl_hardware(root: Path) -> NumaHardware:
    """``numactl -H`` with the fake node/cpu dirs bind-mounted over the real ones, inside a
    private mount namespace (the real /sys is never written)."""
    if os.geteuid() != 0:
        pytest.fail("numactl -H over a fake sysfs needs root (unshare -m and bind mounts)")
    sysd = root / "sys/devices/system"
    script = (
        f"mount --bind '{sysd}/node' /sys/devices/system/node && "
        f"mount --bind '{sysd}/cpu' /sys/devices/system/cpu && exec '{need('numactl')}' -H"
    )
    out = run([need("unshare"), "-m", "--propagation", "private", "sh", "-c", script])
    hw = NumaHardware()
    lines = out.splitlines()
    in_dist = False
    for line in lines:
        words = line.split()
        if line.startswith("available:"):
            continue
        if line.startswith("node distances:"):
            in_dist = True
            continue
        if in_dist:
            if words and words[0].endswith(":"):
                hw.distances.append([int(w) for w in words[1:]])
            continue
        if len(words) >= 3 and words[0] == "node" and words[2] == "cpus:":
            n = int(words[1])
            hw.nodes.append(n)
            hw.cpus[n] = [int(w) for w in words[3:]]
        elif len(words) >= 4 and words[0] == "node" and words[2] == "size:":
            hw.size_mb[int(words[1])] = int(words[3])
    return hw


# -- ibstat (infiniband-diags, libibumad) -----------------------------------------------
@dataclass
class IbCa:
    fields: dict[str, str] = field(default_factory=dict)  # "CA type", "Node GUID", ...
    ports: dict[int, dict[str, str]] = field(default_factory=dict)  # "State", "Rate", ...


def ibstat(root: Path, *args: str) -> dict[str, IbCa]:
    """``ibstat`` by CA name. libibumad hardcodes /sys, so the fake root's sys, dev and proc
    are bind-mounted over the real ones inside a private mount namespace (the real ones are
    never written); ibstat itself runs unmodified."""
    if os.geteuid() != 0:
        pytest.fail("ibstat over a fake sysfs needs root (unshare -m and bind mounts)")
    binds = " && ".join(f"mount --bind '{root / d}' /{d}" for d in ("sys", "dev", "proc"))
    script = f"{binds} && exec '{need('ibstat')}' {' '.join(args)}"
    out = run([need("unshare"), "-m", "--propagation", "private", "sh", "-c", script])
    cas: dict[str, IbCa] = {}
    ca: IbCa | None = None
    port: dict[str, str] | None = None
    for line in out.splitlines():
        if line.startswith("CA '"):
            ca = cas.setdefault(line[4:-1], IbCa())
            port = None
            continue
        assert ca is not None, f"ibstat printed {line!r} before any CA:\n{out}"
        key, _, value = line.strip().partition(":")
        if line.startswith("\tPort ") and not line.startswith("\t\t"):
            port = ca.ports.setdefault(int(key.split()[1]), {})
        elif line.startswith("\t\t") and port is not None:
            port[key] = value.strip()
        else:
            ca.fields[key] = value.strip()
    return cas


# -- lspci ------------------------------------------------------------------------------
def lspci_args(root: Path) -> list[str]:
    return [need("lspci"), "-A", "linux-sysfs", "-O", f"sysfs.path={root}/sys/bus/pci"]


def lspci_records(root: Path) -> dict[str, dict[str, str]]:
    """``lspci -vmmnnDk`` records by slot: Class/Vendor/Device ids in brackets, NUMANode..."""
    out = run([*lspci_args(root), "-vmmnnDk"])
    records: dict[str, dict[str, str]] = {}
    for block in out.strip().split("\n\n"):
        rec: dict[str, str] = {}
        for line in block.splitlines():
            key, _, value = line.partition(":\t")
            rec[key] = value.strip()
        if "Slot" in rec:
            records[rec["Slot"]] = rec
    return records


def bracket_id(value: str) -> str:
    """``NVIDIA Corporation [10de]`` -> ``10de``."""
    return value.rsplit("[", 1)[1].rstrip("]")
