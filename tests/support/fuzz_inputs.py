"""Structure-aware mutators for profiles and scenarios, and the batch runner the fuzz tests
start as a subprocess.

    python -m tests.support.fuzz_inputs profile|mixed|scenario SEED COUNT [ADDRESS-SPACE-BYTES]

Each example is drawn from ``random.Random(f"{kind}:{SEED}:{i}")`` (so a failure names
its seed and index and can be replayed; ``mixed`` replays the mixed-vendor device edits
tests/profile/test_profile_fuzz.py runs) and put through the whole path (profile, mixed: load ->
resolve -> build every node; scenario: parse -> expand) in a child forked for it alone
(``run_limited``: a warm interpreter, so a fork costs about a millisecond), which limits
its own address space (RLIMIT_AS), CPU time (RLIMIT_CPU) and wall time (an alarm), while
the batch waits for it with a deadline and kills it past that. Judged: only the input
error type may escape, and every problem must carry a line and a column (1:1 only for
a file that could not be parsed at all, or for the document's first value). A child that
crashed, hung or raised anything else is a failure. One JSON line per failure on stdout,
then ``{"done": COUNT}``.
"""

from __future__ import annotations

import copy
import faulthandler
import functools
import gc
import json
import os
import random
import re
import resource
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import yaml

from tests.support.paths import REPO as ROOT

if TYPE_CHECKING:
    from sandbox.errors import ProfileError

PER_EXAMPLE_SECONDS = 30

# Numbers at and past every limit the model and resolver set, and the usual suspects.
NUMBERS: list[Any] = [
    0, 1, -1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 255, 256, 257, 511, 512, 513,
    1023, 1024, 1025, 4095, 4096, 4097, 65535, 65536, 2**31, 2**32, 2**63, 2**64, 10**30,
    -(2**63), 0.5, -0.0, 1e300, float("inf"), float("-inf"), float("nan"),
]
TEXTS: list[Any] = [
    "", ".", "..", "../x", "a/b", "/abs", "../../../../etc/passwd", "x\ny", "a=b", " ",
    "\t", "\u0000", "\u00e9", "gpu0", "nic0", "0x10de", "0xZZ", "80Gi", "1Pi", "2Pi",
    "99999999999999999999999Ti", "0-3,9", "0-999999999999", "3-1", "0-", "\u0663",
    "a" * 300, "{i}", "accel/accel{i}", "nvidia0", "nvidia0/x", "dri/card0", "null",
    "-", "x" * 64, "Worker", "healthy", "unhealthy", "aer-fatal", "removed",
]
SHAPES: list[Any] = [None, True, False, [], {}, [1], {"a": 1}, [[[]]], {"id": 0}]
HOSTILE_DEVICES: list[dict[str, Any]] = [
    {"type": "generic", "vendorId": "0x8086", "deviceId": "0x1", "classCode": "0x120000",
     "driver": "../../../../../victim/passwd",
     "devNodes": [{"name": "../escape", "major": 240, "minor": 0}]},
    {"type": "generic", "vendorId": 1, "deviceId": 2, "classCode": 3, "count": 3,
     "devNodes": [{"name": "accel/accel{i}", "major": 240, "minor": 0},
                  {"name": "accel", "major": 240, "minor": 9}]},
    {"type": "generic", "vendorId": 1, "deviceId": 2, "classCode": 3,
     "devNodes": [{"name": "nvidia0", "major": 195, "minor": 0}]},
    {"type": "gpu", "vendor": "nvidia", "model": "t4", "count": 1024},
    {"type": "nic", "vendor": "mellanox", "model": "connectx-6", "ports": 4, "count": 64,
     "sriov": {"totalVFs": 64, "numVFs": 64}},
]


def seed_profiles() -> list[Any]:
    return [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "profiles").glob("*.yaml"))]


def seed_scenarios() -> list[Any]:
    return [{
        "version": 1, "seed": 7,
        "steps": [
            {"at": 0.5, "do": "health", "device": "gpu0", "health": "unhealthy",
             "reason": "aer-fatal"},
            {"at": 1.0, "do": "unplug", "device": "nic0", "repeat": 3, "every": 2.0},
            {"at": 2.0, "do": "set-vfs", "device": "gpu1", "num_vfs": 4},
            {"at": 3.0, "do": "storm", "changes": 10, "over": 5.0,
             "devices": ["gpu0", "gpu1"], "ops": ["health", "unplug", "plug"]},
            {"at": 9.0, "expect": {"gpu0": {"plugged": True}, "gpu1": {"num_vfs": 4}}},
        ],
    }]


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def _value(rng: random.Random) -> Any:
    pick = rng.random()
    if pick < 0.45:
        return rng.choice(NUMBERS)
    if pick < 0.85:
        return rng.choice(TEXTS)
    return copy.deepcopy(rng.choice(SHAPES))


def mutate(doc: Any, rng: random.Random, keys: list[str]) -> Any:
    """1-4 structural edits: replace a value, drop or add a key, duplicate or nest."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 4)):
        paths = _paths(doc)
        path = rng.choice(paths)
        op = rng.randrange(8)
        if not path:
            if op == 0:
                return _value(rng)
            continue
        parent = _get(doc, path[:-1])
        key = path[-1]
        if op <= 2:
            parent[key] = _value(rng)
        elif op == 3 and isinstance(parent, dict):
            del parent[key]
        elif op == 3 and isinstance(parent, list):
            parent.pop(key)
        elif op == 4 and isinstance(parent, dict):
            parent[rng.choice(keys)] = _value(rng)
        elif op == 5 and isinstance(parent, list):
            parent.extend(copy.deepcopy(parent[key]) for _ in range(rng.choice([1, 2, 70])))
        elif op == 6:
            deep: Any = parent[key]
            for _ in range(rng.choice([2, 70, 200])):
                deep = [deep]
            parent[key] = deep
        elif op == 7 and isinstance(_get(doc, path[:-1]), dict) and keys[0] == "apiVersion":
            node = doc.get("nodes") if isinstance(doc, dict) else None
            if isinstance(node, list) and node and isinstance(node[0], dict):
                devs = node[0].setdefault("devices", [])
                if isinstance(devs, list):
                    devs.append(copy.deepcopy(rng.choice(HOSTILE_DEVICES)))
    return doc


def render_text(doc: Any, rng: random.Random) -> str:
    try:
        text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=rng.random() < 0.5,
                              width=rng.choice([80, 10**6]))
    except (yaml.YAMLError, ValueError):
        text = repr(doc)
    except RecursionError:  # nested past what the dumper can write: nest the text instead
        n = rng.choice([500, 5000, 100_000])
        text = "steps: " + "[" * n + "]" * n
    r = rng.random()
    if r < 0.05 and text:
        cut = rng.randrange(len(text))
        text = text[:cut]  # truncated
    elif r < 0.10 and text:
        at = rng.randrange(len(text))
        text = text[:at] + rng.choice(["\t", "{", "[", "&a ", "*a", "<<: *a\n", "!!python/int 1",
                                       ": ", "- ", "\"", "'", "%YAML 1.1\n---\n"]) + text[at:]
    return text


PROFILE_KEYS = [
    "apiVersion", "kind", "metadata", "name", "nodes", "count", "cpu", "sockets",
    "coresPerSocket", "threadsPerCore", "vendor", "numa", "id", "cpus", "memory", "devices",
    "type", "model", "numaNode", "pciAddresses", "sriov", "totalVFs", "numVFs", "ports",
    "labels", "devNodes", "driver", "partitions", "hugepages", "distances", "pci",
    "hostBridges", "bus", "domain", "switches", "switch", "health", "healthReason", "colour",
]
SCENARIO_KEYS = [
    "version", "seed", "steps", "at", "do", "device", "health", "reason", "repeat", "every",
    "num_vfs", "changes", "over", "devices", "ops", "expect", "plugged", "max_vfs", "nope",
]


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


def edit_values(doc: Any, rng: random.Random) -> Any:
    """1-3 small edits: a value replaced by one near a limit, a key dropped or added."""
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(_paths(doc))
        if not path:
            continue
        parent = _get(doc, path[:-1])
        op = rng.randrange(4)
        if op <= 1:
            parent[path[-1]] = copy.deepcopy(rng.choice(NEAR_LIMITS))
        elif op == 2 and isinstance(parent, dict):
            del parent[path[-1]]
        elif op == 2 and isinstance(parent, list):
            parent.pop(path[-1])
        elif isinstance(parent, dict):
            parent[rng.choice(PROFILE_KEYS + ["afuIds", "drm", "linkLayer", "rdma",
                                              "namespaces", "lbaSize", "vendorId"])] = \
                copy.deepcopy(rng.choice(NEAR_LIMITS))
    return doc


def mixed_case(seed: int, i: int, seeds: list[Any]) -> str:
    """A seed (a shipped profile one time in ten, else a small mixed-vendor one: that
    loads and builds in a fraction of the time) under device edits and, half the time,
    small value edits too; YAML by libyaml's emitter where it has one, in block or flow
    style."""
    rng = random.Random(f"mixed:{seed}:{i}")
    doc = mutate_devices(rng.choice(seeds) if rng.random() < 0.1 else rng.choice(MIXED_SEEDS),
                         rng)
    if rng.random() < 0.5:
        doc = edit_values(doc, rng)
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    try:
        return yaml.dump(doc, Dumper=dumper, sort_keys=False, allow_unicode=True,
                         default_flow_style=rng.choice([False, None]))
    except (yaml.YAMLError, ValueError, RecursionError):
        return render_text(doc, rng)


PER_EXAMPLE_CPU_SECONDS = 20
DEADLINE_GRACE = 15  # seconds past the child's own alarm before the batch kills it
DEFAULT_MEMORY = 2 << 30


def _alarm(_signum: int, _frame: Any) -> None:
    raise TimeoutError(f"example took more than {PER_EXAMPLE_SECONDS} s")


def run_limited(fn: Callable[[], str | None], *, memory: int = DEFAULT_MEMORY,
                cpu_seconds: int = PER_EXAMPLE_CPU_SECONDS,
                wall_seconds: int = PER_EXAMPLE_SECONDS,
                grace: float = DEADLINE_GRACE) -> str | None:
    """``fn()`` in a forked child under an address-space, CPU-time and wall-time limit.

    ``fn`` returns None (fine) or what went wrong; any exception it raises is what went
    wrong too. Returns None, or a description of the failure: what ``fn`` said, the
    child's traceback, or how it died (a signal, its CPU limit, the deadline)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            os.close(r)
            report = open(w, "wb", buffering=0, closefd=False)  # noqa: SIM115
            faulthandler.enable(report)  # a fatal signal's traceback goes to the parent
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 5))
            signal.signal(signal.SIGALRM, _alarm)
            signal.alarm(wall_seconds)
            try:
                verdict = fn()
            except BaseException as exc:  # noqa: BLE001 - anything is what we hunt
                verdict = "".join(traceback.format_exception(exc))[-4000:]
            signal.alarm(0)
            if verdict:
                data = verdict.encode("utf-8", "backslashreplace")
                while data:
                    data = data[os.write(w, data):]
        except BaseException:  # noqa: BLE001 - even the report failed: say so by the code
            code = 3
        os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + wall_seconds + grace
    hung = False
    try:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([r], [], [], max(left, 0))
            if not ready:
                hung = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    said = b"".join(chunks).decode("utf-8", "replace")
    if hung:
        return f"hung: no exit within {wall_seconds + grace:g} s (killed)\n{said}"
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status))
        why = f" (more than {cpu_seconds} s of CPU)" if sig is signal.SIGXCPU else ""
        return f"crashed: killed by {sig.name}{why}\n{said}"
    if os.WEXITSTATUS(status) != 0:
        return f"crashed: exited {os.WEXITSTATUS(status)}\n{said}"
    return said or None


def _top_level(path: str, text: str) -> bool:
    """Whether ``path`` names the document itself or one of its top-level keys, and the
    document starts at line 1, column 1 (so 1:1 is where it is)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError, ValueError):
        return False
    if root is None or (root.start_mark.line, root.start_mark.column) != (0, 0):
        return False
    keys = {str(k.value) for k, _ in root.value} if isinstance(root, yaml.MappingNode) else set()
    return path in keys or ("." not in path and "[" not in path)


PROFILE_WHOLE_FILE = ("invalid YAML", "empty file")
SCENARIO_WHOLE_FILE = ("not YAML", "empty file")


def check_profile(text: str, name: str) -> str | None:
    """Load, resolve and build every node of ``text``: None if only located ProfileErrors
    came out, else what is wrong."""
    from sandbox.errors import ProfileError
    from sandbox.fakehw.builder import build_tree
    from sandbox.profile import load_profile_text

    try:
        cluster = load_profile_text(text, name).cluster
        for node in cluster.nodes:
            build_tree(node)
    except ProfileError as exc:
        return unlocated(exc, text, name) or masked_build_failure(exc)
    return None


# The one build failure a valid-looking profile may get as a ProfileError: its generic
# devices' devNodes (a name or a number the profile chose) taking another device's node.
_DEV_NODE_CLASH = re.compile(r"cannot build: (dev|sys/dev/(char|block))/\S+: already ")


def masked_build_failure(exc: ProfileError) -> str | None:
    """The loader builds a node whose generic devices have devNodes and reports a
    TreeError as "cannot build: ..." at their devNodes: right for a clash of those nodes,
    a builder bug passed off as the profile's fault for anything else (an fpga_region
    numbered twice)."""
    bad = [str(p) for p in exc.problems
           if p.message.startswith("cannot build:") and not _DEV_NODE_CLASH.match(p.message)]
    return f"a build failure reported as the profile's: {bad}" if bad else None


def unlocated(exc: ProfileError, text: str, name: str) -> str | None:
    """What is wrong with the problems of a ProfileError for ``text`` (file ``name``):
    None if every one is located (``name:line:col``, 1:1 only where that is the value)."""
    if not exc.problems:
        return "ProfileError without problems"
    bad = [str(p) for p in exc.problems
           if p.file != name or p.line < 1 or p.column < 1 or not p.message]
    whole = len(exc.problems) == 1 and not exc.problems[0].path and \
        exc.problems[0].message.startswith(PROFILE_WHOLE_FILE)
    at_start = [p for p in exc.problems if (p.line, p.column) == (1, 1)]
    if at_start and not whole and not all(_top_level(p.path, text) for p in at_start):
        bad += [str(p) for p in at_start]
    return f"unlocated problem(s): {bad}" if bad else None


_LOCATED = re.compile(r"(?P<line>[0-9]+):(?P<col>[0-9]+): (?P<rest>.*)", re.DOTALL)


def check_scenario(text: str, source: str) -> str | None:
    """Parse and expand ``text``: None if only located ScenarioErrors came out."""
    from sandbox.errors import ScenarioError
    from sandbox.fakehw.control.scenario import expand, parse_scenario_text

    try:
        expand(parse_scenario_text(text, source=source), ["gpu0", "nic0"])
    except ScenarioError as exc:
        if not exc.problems:
            return "ScenarioError without problems"
        bad = []
        for problem in exc.problems:
            m = _LOCATED.fullmatch(problem[len(source) + 1:]) \
                if problem.startswith(source + ":") else None
            if m is None or int(m["line"]) < 1 or int(m["col"]) < 1 or not m["rest"]:
                bad.append(problem)
            elif (m["line"], m["col"]) == ("1", "1"):
                whole = len(exc.problems) == 1 and m["rest"].startswith(SCENARIO_WHOLE_FILE)
                path = "" if m["rest"].startswith("expected a mapping") else \
                    m["rest"].split(": ", 1)[0]
                if not whole and not _top_level(path, text):
                    bad.append(problem)
        return f"unlocated problem(s): {bad}" if bad else None
    return None


def profile_case(seed: int, i: int, seeds: list[Any]) -> str:
    rng = random.Random(f"profile:{seed}:{i}")
    return render_text(mutate(rng.choice(seeds), rng, PROFILE_KEYS), rng)


def scenario_case(seed: int, i: int, seeds: list[Any]) -> str:
    rng = random.Random(f"scenario:{seed}:{i}")
    text = render_text(mutate(rng.choice(seeds), rng, SCENARIO_KEYS), rng)
    if rng.random() < 0.03:
        text = text.encode("utf-8").decode("latin-1") + "\udcff"  # not clean text
    return text


def run_batch(kind: str, seed: int, count: int, memory: int) -> None:
    """Every example of a batch, each in its own limited child (see the module doc)."""
    import sandbox.fakehw.builder  # noqa: F401 - warm: every child starts with these loaded
    import sandbox.fakehw.control.scenario  # noqa: F401
    import sandbox.profile  # noqa: F401

    seeds = seed_scenarios() if kind == "scenario" else seed_profiles()
    make = {"profile": profile_case, "mixed": mixed_case, "scenario": scenario_case}[kind]
    check = check_scenario if kind == "scenario" else check_profile
    for k, doc in enumerate(seeds):  # warm the parent's lazy caches: a child's start is
        warm = check(yaml.safe_dump(doc, sort_keys=False), f"seed-{k}")  # cheaper then
        if warm:
            _fail(kind, seed, -1 - k, f"an unmutated seed fails: {warm}", str(doc))
    gc.collect()
    gc.freeze()  # no collection in a child touches (and so copies) the parent's objects
    for i in range(count):
        text = make(seed, i, seeds)
        name = f"fuzz-{seed}-{i}" + ("" if kind == "scenario" else ".yaml")
        verdict = run_limited(functools.partial(check, text, name), memory=memory)
        if verdict:
            _fail(kind, seed, i, verdict, text)
    print(json.dumps({"done": count}), flush=True)


def _fail(kind: str, seed: int, i: int, error: str, text: str) -> None:
    print(json.dumps({"kind": kind, "seed": seed, "index": i, "error": error.strip(),
                      "input": text[:2000]}), flush=True)


def main() -> None:
    kind, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    memory = int(sys.argv[4]) if len(sys.argv) > 4 else DEFAULT_MEMORY
    run_batch(kind, seed, count, memory)


if __name__ == "__main__":
    main()
