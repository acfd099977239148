"""Mixed-vendor device edits for the profile fuzz (tests/support/fuzz_inputs.py's ``mixed``
kind): small seed profiles and edits that put device entries of every kind and vendor of
the catalogue next to each other, in every order."""

from __future__ import annotations

import copy
import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


# -- mixed-vendor device mutations ------------------------------------------------------
# Where one kernel id space spans device entries and vendors (fpga_region, dfl-fme/port,
# DRM minors, RDMA devices, uverbs, NVMe controllers, vfio groups), a profile that
# validates can still fail to build: these edits put entries of every kind and vendor of
# the catalogue next to each other, in every order (issue 21 item 5 was two Intel DFL
# cards, a Xilinx one, two more Intel ones).

MIXED_SEEDS: list[dict[str, Any]] = [
    {"apiVersion": "hwsandbox.dev/v1alpha1", "kind": "HardwareProfile",
     "metadata": {"name": "fpga-mix"},
     "nodes": [{"name": "fpga", "cpu": {"sockets": 2, "coresPerSocket": 2}, "memory": "4Gi",
                "devices": [
         {"type": "fpga", "vendor": "intel", "model": "pac-n3000", "count": 2},
         {"type": "fpga", "vendor": "xilinx", "model": "alveo-u250"},
         {"type": "fpga", "vendor": "intel", "model": "pac-d5005", "count": 2, "ports": 2,
          "numaNode": 1},
         {"type": "fpga", "vendor": "xilinx", "model": "alveo-u200", "numaNode": 1}]}]},
    {"apiVersion": "hwsandbox.dev/v1alpha1", "kind": "HardwareProfile",
     "metadata": {"name": "gpu-mix"},
     "nodes": [{"name": "gpu", "cpu": {"sockets": 2, "coresPerSocket": 2}, "memory": "4Gi",
                "devices": [
         {"type": "gpu", "vendor": "nvidia", "model": "l40s", "drm": True},
         {"type": "gpu", "vendor": "amd", "model": "mi210"},
         {"type": "gpu", "vendor": "intel", "model": "flex-140",
          "sriov": {"totalVFs": 4, "numVFs": 2}, "numaNode": 1},
         {"type": "gpu", "vendor": "nvidia", "model": "t4", "numaNode": 1},
         {"type": "fpga", "vendor": "intel", "model": "pac-a10"}]}]},
    {"apiVersion": "hwsandbox.dev/v1alpha1", "kind": "HardwareProfile",
     "metadata": {"name": "net-mix"},
     "nodes": [{"name": "net", "cpu": {"sockets": 2, "coresPerSocket": 2},
                "memory": "4Gi", "pci": {"switches": [{"name": "sw0", "numaNode": 1}]},
                "devices": [
         {"type": "nic", "vendor": "mellanox", "model": "connectx-7",
          "linkLayer": "infiniband"},
         {"type": "nic", "vendor": "intel", "model": "e810-c", "ports": 2,
          "sriov": {"totalVFs": 2, "numVFs": 1}},
         {"type": "nic", "vendor": "mellanox", "model": "connectx-6dx", "ports": 2,
          "switch": "sw0", "numaNode": 1},
         {"type": "nic", "vendor": "intel", "model": "x710"},
         {"type": "nvme", "vendor": "samsung", "model": "pm9a3", "namespaces": 2},
         {"type": "nvme", "vendor": "kioxia", "model": "cm6"}]}]},
    {"apiVersion": "hwsandbox.dev/v1alpha1", "kind": "HardwareProfile",
     "metadata": {"name": "accel-mix"},
     "nodes": [{"name": "acc", "memory": "2Gi", "devices": [
         {"type": "generic", "name": "qat", "vendorId": "0x8086", "deviceId": "0x4940",
          "classCode": "0x0b4000", "driver": "vfio-pci", "count": 2,
          "devNodes": [{"name": "accel/accel{i}", "major": 261, "minor": 0}]},
         {"type": "fpga", "vendor": "xilinx", "model": "alveo-u250", "count": 2},
         {"type": "gpu", "vendor": "amd", "model": "mi300x"},
         {"type": "fpga", "vendor": "intel", "model": "pac-n3000"}]}]},
]
_TABLES: dict[str, str] = {"gpu": "GPUS", "nic": "NICS", "fpga": "FPGAS", "nvme": "NVMES"}
_GENERIC_NODES: list[dict[str, Any]] = [  # some free, some another device's node
    {"name": "accel/accel{i}", "major": 261, "minor": 0},
    {"name": "hl{i}", "major": 508, "minor": 0},
    {"name": "qat_adf_ctl", "major": 10, "minor": 60},
    {"name": "dri/card{i}", "major": 226, "minor": 0},
    {"name": "dfl-port.{i}", "major": 240, "minor": 0},
]


def _models(kind: str) -> dict[str, dict[str, Any]]:
    from sandbox.profile import catalogue

    return getattr(catalogue, _TABLES[kind])  # type: ignore[no-any-return]


def catalogue_device(rng: random.Random, numa_nodes: int = 2) -> dict[str, Any]:
    """A device entry of any kind, vendor and catalogue model, with options: mostly valid,
    now and then a model of another vendor or a NUMA node the node lacks."""
    kind = rng.choice(["fpga", "fpga", "fpga", "gpu", "gpu", "nic", "nic", "nvme", "generic"])
    if kind == "generic":
        out: dict[str, Any] = {"type": kind, "vendorId": rng.choice(["0x8086", "0x1ded"]),
                               "deviceId": rng.choice(["0x4940", "0x1"]),
                               "classCode": rng.choice(["0x0b4000", "0x120000"])}
        if rng.random() < 0.6:
            out["devNodes"] = [copy.deepcopy(rng.choice(_GENERIC_NODES))]
        if rng.random() < 0.3:
            out["driver"] = rng.choice(["vfio-pci", "4xxx", "habanalabs"])
    else:
        table = _models(kind)
        vendor = rng.choice(sorted(table))
        models = sorted(table[rng.choice(sorted(table))] if rng.random() < 0.03
                        else table[vendor])
        out = {"type": kind, "vendor": vendor, "model": rng.choice(models)}
        entry = table[vendor].get(out["model"])
        if kind == "fpga" and rng.random() < 0.4:
            out["ports"] = rng.randint(1, 8)
            if rng.random() < 0.5:
                n = out["ports"] if rng.random() < 0.8 else rng.randint(1, 9)
                out["afuIds"] = [f"{rng.getrandbits(128):032x}" for _ in range(n)]
        elif kind == "gpu" and entry is not None:
            if vendor == "nvidia" and rng.random() < 0.5:
                out["drm"] = True
            if entry.max_vfs and rng.random() < 0.5:
                total = rng.randint(1, min(entry.max_vfs, rng.choice([2, 4, 4, 16, 64])))
                out["sriov"] = {"totalVFs": total, "numVFs": rng.randint(0, total)}
            if entry.memory_slices and rng.random() < 0.2:
                out["partitions"] = {"profiles": [
                    {"name": "1g", "memorySlices": 1, "computeSlices": 1}]}
        elif kind == "nic" and entry is not None:
            if rng.random() < 0.5:
                out["ports"] = rng.randint(1, 4)
            if vendor == "mellanox" and rng.random() < 0.3:
                out["linkLayer"] = "infiniband"
            if rng.random() < 0.15:
                out["rdma"] = rng.random() < 0.5
            if rng.random() < 0.4:
                total = rng.randint(1, rng.choice([2, 4, 4, 8, 16]))
                out["sriov"] = {"totalVFs": total, "numVFs": rng.randint(0, total)}
        elif kind == "nvme":
            if rng.random() < 0.5:
                out["namespaces"] = rng.randint(1, 4)
            if rng.random() < 0.3:
                out["lbaSize"] = rng.choice([512, 4096])
    if rng.random() < 0.5:
        out["count"] = rng.choice([1, 2, 2, 3, 4, 6])
    if rng.random() < 0.5:
        out["numaNode"] = rng.randrange(numa_nodes + (rng.random() < 0.05))
    if rng.random() < 0.1:
        out["name"] = rng.choice(["gpu", "nic", "fpga", "acc"])
    if rng.random() < 0.05:
        out["health"], out["healthReason"] = "unhealthy", rng.choice(["aer-fatal", "removed"])
    return out


def _device_lists(doc: Any) -> list[list[Any]]:
    """Every node's device list, made where a node has none."""
    nodes = doc.get("nodes") if isinstance(doc, dict) else None
    out: list[list[Any]] = []
    for node in nodes if isinstance(nodes, list) else []:
        if isinstance(node, dict):
            devices = node.setdefault("devices", [])
            if isinstance(devices, list):
                out.append(devices)
    return out


def _numa_nodes(doc: Any) -> int:
    try:
        return max(1, int(doc["nodes"][0]["cpu"]["sockets"]))
    except (KeyError, IndexError, TypeError, ValueError):
        return 1


def mutate_devices(doc: Any, rng: random.Random) -> Any:
    """1-4 device-level edits: add a catalogue device anywhere, duplicate or move an entry,
    switch an entry's vendor (with a model of the new vendor, or keeping its own), change
    its count, or add a node of mixed devices."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 4)):
        lists = _device_lists(doc)
        if not lists:
            return doc
        devices = rng.choice(lists)
        op = rng.randrange(7)
        dicts = [d for d in devices if isinstance(d, dict)]
        if op <= 1 or not dicts:
            devices.insert(rng.randint(0, len(devices)), catalogue_device(rng, _numa_nodes(doc)))
        elif op == 2:
            devices.insert(rng.randint(0, len(devices)), copy.deepcopy(rng.choice(dicts)))
        elif op == 3:
            moved = devices.pop(rng.randrange(len(devices)))
            devices.insert(rng.randint(0, len(devices)), moved)
        elif op == 4:
            entry = rng.choice(dicts)
            if entry.get("type") in _TABLES:
                table = _models(entry["type"])
                entry["vendor"] = rng.choice(sorted(table))
                if rng.random() < 0.9:
                    entry["model"] = rng.choice(sorted(table[entry["vendor"]]))
        elif op == 5:
            rng.choice(dicts)["count"] = rng.choice([1, 2, 3, 4])
        elif isinstance(doc.get("nodes"), list) and len(doc["nodes"]) < 4:
            doc["nodes"].append({"name": f"mix{len(doc['nodes'])}", "memory": "2Gi",
                                 "devices": [catalogue_device(rng, 1)
                                             for _ in range(rng.randint(2, 5))]})
    return doc


# Values near every limit of the profile model, without the ones that make a profile
# big (a count of 1024, 70 copies, 200 levels): ``mutate`` and tests/profile/test_fuzz_inputs.py
# cover those, in children with limits.
NEAR_LIMITS: list[Any] = [
    -1, 0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 255, 256, 257,
    2**31, 2**64, 0.5, -0.0, float("nan"), "", "0x10de", "80Gi", "0-3,9", "3-1", "{i}",
    "accel/accel{i}", "intel", "xilinx", "nvidia", "amd", "mellanox", "dfl", "infiniband",
    "pac-n3000", "alveo-u250", "l40s", "unhealthy", "removed", None, True, [], {},
]
