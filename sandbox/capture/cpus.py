"""CPU, NUMA and memory: proc/cpuinfo, the CPU topology, the NUMA nodes (CPUs, memory,
hugepages, distances), swap and the DMI identity, as the profile's ``cpu``, ``numa``,
``swap`` and ``system`` sections. What the profile cannot say is appended to ``left_out``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sandbox.capture.reading import (
    CONTROL,
    CPU_DIR,
    CPUINFO_LIMIT,
    DMI_DIR,
    NODE_DIR,
    CaptureError,
    Root,
    clean_text,
    quantity,
)
from sandbox.profile import model
from sandbox.profile.cpulist import format_cpulist, parse_cpulist
from sandbox.profile.model import MAX_NUMA_NODES


@dataclass
class _Cpus:
    fields: dict[str, Any]  # the profile's cpu: section
    ncpus: int
    online: list[int]



def _cpuinfo(root: Root) -> dict[str, str]:
    """The first processor's ``key: value`` lines of proc/cpuinfo."""
    out: dict[str, str] = {}
    for line in (root.read("proc/cpuinfo", CPUINFO_LIMIT) or "").splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip(), value.strip())
    return out



def read_cpus(root: Root, left_out: list[str]) -> _Cpus:
    ids = sorted(int(n[3:]) for n in root.names(CPU_DIR, r"cpu[0-9]+"))
    online = _cpulist(root.line(f"{CPU_DIR}/online")) or ids
    present = _cpulist(root.line(f"{CPU_DIR}/present")) or ids
    if online != present:
        offline = format_cpulist(set(present) - set(online))
        left_out.append(f"offline CPUs {offline}: the profile's CPUs are all online")
    topo: dict[int, tuple[int, int, list[int]]] = {}
    for c in online:
        base = f"{CPU_DIR}/cpu{c}/topology"
        pkg = root.number(f"{base}/physical_package_id")
        core = root.number(f"{base}/core_id")
        sib = _cpulist(root.line(f"{base}/thread_siblings_list")) or [c]
        topo[c] = (pkg if pkg is not None and pkg >= 0 else 0,
                   core if core is not None and core >= 0 else c, sib)
    packages = sorted({p for p, _, _ in topo.values()})
    cores_of = {p: sorted({k for q, k, _ in topo.values() if q == p}) for p in packages}
    sockets = len(packages)
    cores = max(len(v) for v in cores_of.values())
    threads = max(len(s) for _, _, s in topo.values())
    if len({len(v) for v in cores_of.values()}) > 1 or len(online) != sockets * cores * threads:
        left_out.append(f"uneven CPU topology ({len(online)} CPUs over {sockets} sockets, "
                        f"up to {cores} cores and {threads} threads each): captured as "
                        f"{sockets} x {cores} x {threads}")
    sockets, cores, threads = _clamp(sockets, 16), _clamp(cores, 512), _clamp(threads, 8)
    _check_numbering(topo, sockets, cores, threads, left_out)
    info = _cpuinfo(root)
    fields: dict[str, Any] = {
        "sockets": sockets,
        "coresPerSocket": cores,
        "threadsPerCore": threads,
        "vendor": clean_text(info.get("vendor_id") or info.get("CPU implementer"), "unknown"),
        "model": clean_text(info.get("model name") or info.get("Processor"), "unknown"),
    }
    family, model_number = _int(info.get("cpu family")), _int(info.get("model"))
    if family is not None:
        fields["family"] = family
    if model_number is not None:
        fields["modelNumber"] = model_number
    try:
        mhz = round(float(info.get("cpu MHz", "")))
    except ValueError:
        mhz = 0
    if mhz >= 1:
        fields["mhz"] = mhz
    return _Cpus(fields, sockets * cores * threads, online)



def _check_numbering(topo: dict[int, tuple[int, int, list[int]]], sockets: int, cores: int,
                     threads: int, left_out: list[str]) -> None:
    """Note where the machine numbers CPUs differently from the resolver (first threads of
    every core socket by socket, then the second threads; core ids 0..N-1 per socket)."""
    ncores = sockets * cores
    expected = {
        t * ncores + s * cores + c: (s, c)
        for t in range(threads) for s in range(sockets) for c in range(cores)
    }
    for cpu, (pkg, core, _sib) in sorted(topo.items()):
        if expected.get(cpu) != (pkg, core):
            left_out.append(f"CPU numbering: cpu{cpu} is package {pkg} core {core} here; the "
                            f"tree numbers it {expected.get(cpu, '(none)')} (socket, core)")
            return



def _clamp(value: int, maximum: int) -> int:
    return max(1, min(value, maximum))



def _int(text: str | None) -> int | None:
    try:
        return int(text or "", 0)
    except ValueError:
        return None



def _cpulist(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        return parse_cpulist(text, 1 << 16)
    except ValueError:
        return []



def _meminfo_kb(text: str | None, key: str) -> int | None:
    for line in (text or "").splitlines():
        parts = line.replace(":", " ").split()
        if key in parts:
            i = parts.index(key)
            if i + 1 < len(parts) and parts[i + 1].isdigit():
                return int(parts[i + 1])
    return None



def read_numa(root: Root, cpus: _Cpus, left_out: list[str]) -> list[dict[str, Any]]:
    names = root.names(NODE_DIR, r"node[0-9]+")
    node_ids = sorted(int(n[4:]) for n in names)
    if not node_ids:
        kb = _meminfo_kb(root.read("proc/meminfo"), "MemTotal") or 0
        left_out.append(f"no {NODE_DIR}: one NUMA node with every CPU")
        return [{"id": 0, "cpus": format_cpulist(range(cpus.ncpus)),
                 "memory": quantity(kb * 1024 - kb * 1024 % 4096)}]
    if node_ids != list(range(len(node_ids))):
        left_out.append(f"NUMA node ids {format_cpulist(node_ids)} renumbered 0.."
                        f"{len(node_ids) - 1} (the profile numbers them in order)")
    if len(node_ids) > MAX_NUMA_NODES:
        raise CaptureError(f"{len(node_ids)} NUMA nodes; a profile holds at most "
                           f"{MAX_NUMA_NODES}")
    nodes: list[dict[str, Any]] = []
    for k, nid in enumerate(node_ids):
        base = f"{NODE_DIR}/node{nid}"
        listed = [c for c in _cpulist(root.line(f"{base}/cpulist")) if c < cpus.ncpus]
        kb = _meminfo_kb(root.read(f"{base}/meminfo"), "MemTotal") or 0
        entry: dict[str, Any] = {"id": k, "cpus": format_cpulist(listed),
                                 "memory": quantity(kb * 1024 - kb * 1024 % 4096)}
        pages: dict[str, int] = {}
        for d in root.names(f"{base}/hugepages", r"hugepages-[0-9]+kB"):
            count = root.number(f"{base}/hugepages/{d}/nr_hugepages")
            if count:
                pages[quantity(int(d[10:-2]) * 1024)] = count
        if pages:
            entry["hugepages"] = pages
        nodes.append(entry)
    return nodes



def read_swap(root: Root) -> str | None:
    """The swap size: SwapTotal counts every swap area but its header page (4 KiB)."""
    kb = _meminfo_kb(root.read("proc/meminfo"), "SwapTotal")
    if not kb:
        return None
    areas = max(1, len((root.read("proc/swaps") or "").strip().splitlines()) - 1)
    return quantity((kb + 4 * areas) * 1024)



_DMI_FIELDS = {
    "vendor": "sys_vendor", "product": "product_name", "version": "product_version",
}
_DMI_BOARD = {"vendor": "board_vendor", "name": "board_name", "version": "board_version"}
_DMI_BIOS = {"vendor": "bios_vendor", "version": "bios_version", "date": "bios_date"}



def read_system(root: Root) -> dict[str, Any] | None:
    """The DMI identity (sys/devices/virtual/dmi/id), where this profile version has it."""
    if "system" not in model.Node.model_fields or not root.exists(DMI_DIR):
        return None

    def section(names: dict[str, str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, name in names.items():
            value = root.line(f"{DMI_DIR}/{name}")
            if value and not CONTROL.search(value) and len(value) <= 256:
                out[key] = value
        return out

    system = section(_DMI_FIELDS)
    board, bios = section(_DMI_BOARD), section(_DMI_BIOS)
    if "date" in bios and not re.fullmatch(r"(0[1-9]|1[0-2])/(0[1-9]|[12][0-9]|3[01])/"
                                           r"[0-9]{4}", bios["date"]):
        del bios["date"]
    if board:
        system["board"] = board
    if bios:
        system["bios"] = bios
    chassis = root.number(f"{DMI_DIR}/chassis_type")
    if chassis is not None and 1 <= chassis <= 0x24:
        system["chassisType"] = chassis
    return system or None



def read_distances(root: Root, count: int, left_out: list[str]) -> list[list[int]] | None:
    ids = sorted(int(n[4:]) for n in root.names(NODE_DIR, r"node[0-9]+"))
    matrix: list[list[int]] = []
    for nid in ids:
        row = (root.line(f"{NODE_DIR}/node{nid}/distance") or "").split()
        if len(row) != count or not all(x.isdigit() for x in row):
            return None
        matrix.append([int(x) for x in row])
    default = [[10 if a == b else 21 for b in range(count)] for a in range(count)]
    if not matrix or matrix == default:
        return None
    ok = all(
        (matrix[a][b] == 10) if a == b else (11 <= matrix[a][b] <= 254
                                             and matrix[a][b] == matrix[b][a])
        for a in range(count) for b in range(count)
    )
    if not ok:
        left_out.append("NUMA distances (not a symmetric 10-local matrix the profile takes)")
        return None
    return matrix
