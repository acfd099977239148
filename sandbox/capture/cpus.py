"""CPU, NUMA and memory: proc/cpuinfo, the CPU topology, the NUMA nodes (CPUs, memory,
hugepages, distances), swap and the DMI identity, as the profile's ``cpu``, ``numa``,
``swap`` and ``system`` sections. What the profile cannot say is appended to ``left_out``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from sandbox.capture.reading import (
    CONTROL,
    CPU_DIR,
    CPUINFO_LIMIT,
    DMI_DIR,
    NODE_DIR,
    Root,
    clean_text,
    decimal,
    quantity,
)
from sandbox.errors import CaptureError
from sandbox.profile import model
from sandbox.profile.cpulist import format_cpulist, parse_cpulist
from sandbox.profile.model import MAX_NUMA_NODES, MAX_QUANTITY
from sandbox.profile.resolve import limits


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



def _most(field: str) -> int:
    """The largest value the profile's ``cpu.<field>`` takes (its ``le`` bound)."""
    return next(int(m.le) for m in model.Cpu.model_fields[field].metadata
                if getattr(m, "le", None) is not None)



def read_cpus(root: Root, left_out: list[str]) -> _Cpus:
    ids = sorted(int(n[3:]) for n in root.names(CPU_DIR, r"cpu[0-9]+"))
    listed = _cpulist(root.line(f"{CPU_DIR}/online"))
    online = listed or ids
    if len(online) > limits.MAX_CPUS:  # counted before any CPU's topology is read
        source = f"{CPU_DIR}/online" if listed else f"{CPU_DIR}/cpuN"
        raise CaptureError(f"{root.where}: {len(online)} online CPUs ({source}); a profile "
                           f"holds at most {limits.MAX_CPUS}")
    present = _cpulist(root.line(f"{CPU_DIR}/present")) or ids
    if online != present:
        offline = format_cpulist(set(present) - set(online))
        left_out.append(f"offline CPUs {offline}: the profile's CPUs are all online")
    most_threads = _most("threads_per_core")
    topo: dict[int, tuple[int, int, int]] = {}  # cpu: package, core, threads of its core
    for c in online:
        base = f"{CPU_DIR}/cpu{c}/topology"
        pkg = root.number(f"{base}/physical_package_id")
        core = root.number(f"{base}/core_id")
        threads = len(_cpulist(root.line(f"{base}/thread_siblings_list"))) or 1
        if threads > most_threads:
            raise CaptureError(f"{root.where}: {threads} threads in the core of cpu{c} "
                               f"({base}/thread_siblings_list); a profile's threadsPerCore "
                               f"is at most {most_threads}")
        topo[c] = (pkg if pkg is not None and pkg >= 0 else 0,
                   core if core is not None and core >= 0 else c, threads)
    packages = sorted({p for p, _, _ in topo.values()})
    cores_of = {p: sorted({k for q, k, _ in topo.values() if q == p}) for p in packages}
    sockets = len(packages)
    cores = max(len(v) for v in cores_of.values())
    threads = max(n for _, _, n in topo.values())
    _check_shape(root, cores_of, threads, len(online))
    if len({len(v) for v in cores_of.values()}) > 1 or len(online) != sockets * cores * threads:
        left_out.append(f"uneven CPU topology ({len(online)} CPUs over {sockets} sockets, "
                        f"up to {cores} cores and {threads} threads each): captured as "
                        f"{sockets} x {cores} x {threads}")
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
        mhz = float(info.get("cpu MHz", ""))
    except ValueError:
        mhz = 0.0
    if math.isfinite(mhz) and 1 <= round(mhz) < 1 << 20:  # inf, nan, 1e999: not a clock
        fields["mhz"] = round(mhz)
    return _Cpus(fields, sockets * cores * threads, online)



def _check_shape(root: Root, cores_of: dict[int, list[int]], threads: int, ncpus: int) -> None:
    """Refuse a topology the profile cannot hold (never captured as a smaller one)."""
    where = root.where
    if len(cores_of) > _most("sockets"):
        raise CaptureError(f"{where}: {len(cores_of)} packages under {CPU_DIR} "
                           f"(physical_package_id); a profile's sockets is at most "
                           f"{_most('sockets')}")
    package, cores = max(cores_of.items(), key=lambda kv: (len(kv[1]), -kv[0]))
    if len(cores) > _most("cores_per_socket"):
        raise CaptureError(f"{where}: {len(cores)} cores in package {package} under {CPU_DIR} "
                           f"(core_id); a profile's coresPerSocket is at most "
                           f"{_most('cores_per_socket')}")
    total = len(cores_of) * len(cores) * threads
    if total > limits.MAX_CPUS:
        raise CaptureError(f"{where}: {ncpus} online CPUs under {CPU_DIR} with an uneven "
                           f"topology ({len(cores_of)} packages, up to {len(cores)} cores "
                           f"and {threads} threads each) would be captured as "
                           f"{len(cores_of)} x {len(cores)} x {threads} = {total} "
                           f"logical CPUs; a profile holds at most {limits.MAX_CPUS}")



def _check_numbering(topo: dict[int, tuple[int, int, int]], sockets: int, cores: int,
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



def _int(text: str | None) -> int | None:
    """cpuinfo's family and model: a number >= 0 (decimal, or 0x hex on some arches)."""
    text = (text or "").strip()
    if not text.isascii() or len(text) > 20:
        return None
    try:
        value = int(text, 0)
    except ValueError:
        return None
    return value if value >= 0 else None



_CPU_NUMBERS = 1 << 16  # CPU numbers a cpulist may hold: 0 to 65535



def _cpulist(text: str | None) -> list[int]:
    """The CPUs a cpulist names, in order, each once; [] when it is missing or not one.

    Its ranges are counted before any is expanded: CPU numbers are below 65536, so a list
    naming more than 65536 (``0-65535,0-65535,...`` is 64 KiB of 8 million) is not one."""
    if not text:
        return []
    named = 0
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        ok = lo.isascii() and lo.isdigit() and len(lo) <= 9 and hi.isascii() and (
            not sep or (hi.isdigit() and len(hi) <= 9))
        named += max(1, int(hi) - int(lo) + 1) if ok and sep else 1
        if named > _CPU_NUMBERS:
            return []
    try:
        return sorted(set(parse_cpulist(text, _CPU_NUMBERS)))
    except ValueError:
        return []



def _meminfo_kb(text: str | None, key: str) -> int | None:
    for line in (text or "").splitlines():
        parts = line.replace(":", " ").split()
        if key in parts:
            i = parts.index(key)
            return decimal(parts[i + 1]) if i + 1 < len(parts) else None
    return None



def _memory(root: Root, rel: str, key: str, kb: int) -> str:
    """``kb`` kibibytes as a quantity; a ``CaptureError`` past what a profile takes."""
    nbytes = kb * 1024 - kb * 1024 % 4096
    if nbytes > MAX_QUANTITY:
        raise CaptureError(f"{root.where}: {rel}: {key} {kb} kB; a profile holds at most "
                           f"{quantity(MAX_QUANTITY)} there")
    return quantity(nbytes)



def read_numa(root: Root, cpus: _Cpus, left_out: list[str]) -> list[dict[str, Any]]:
    names = root.names(NODE_DIR, r"node[0-9]+")
    node_ids = sorted(int(n[4:]) for n in names)
    if not node_ids:
        kb = _meminfo_kb(root.read("proc/meminfo"), "MemTotal") or 0
        left_out.append(f"no {NODE_DIR}: one NUMA node with every CPU")
        return [{"id": 0, "cpus": format_cpulist(range(cpus.ncpus)),
                 "memory": _memory(root, "proc/meminfo", "MemTotal", kb)}]
    if len(node_ids) > MAX_NUMA_NODES:
        raise CaptureError(f"{root.where}: {len(node_ids)} NUMA nodes under {NODE_DIR}; a "
                           f"profile holds at most {MAX_NUMA_NODES}")
    if node_ids != list(range(len(node_ids))):
        left_out.append(f"NUMA node ids {format_cpulist(node_ids)} renumbered 0.."
                        f"{len(node_ids) - 1} (the profile numbers them in order)")
    nodes: list[dict[str, Any]] = []
    lists = _numa_cpus(root, node_ids, cpus.ncpus, left_out)
    for k, nid in enumerate(node_ids):
        base = f"{NODE_DIR}/node{nid}"
        kb = _meminfo_kb(root.read(f"{base}/meminfo"), "MemTotal") or 0
        memory = kb * 1024 - kb * 1024 % 4096
        entry: dict[str, Any] = {"id": k, "cpus": format_cpulist(lists[k]),
                                 "memory": _memory(root, f"{base}/meminfo", "MemTotal", kb)}
        pages: dict[str, int] = {}
        taken = 0
        for d in root.names(f"{base}/hugepages", r"hugepages-[0-9]+kB"):
            count = decimal(root.line(f"{base}/hugepages/{d}/nr_hugepages"))
            size = int(d[10:-2]) * 1024
            if count and 4096 <= size <= MAX_QUANTITY:  # a page size the profile takes
                pages[quantity(size)] = count
                taken += size * count
        if taken > memory:
            held = ", ".join(f"{c} x {size}" for size, c in pages.items())
            left_out.append(f"NUMA node {nid}: hugepages ({held}) more than its memory "
                            f"({quantity(memory)}): left out")
        elif pages:
            entry["hugepages"] = pages
        nodes.append(entry)
    return nodes



def _numa_cpus(root: Root, node_ids: list[int], ncpus: int, left_out: list[str]
               ) -> list[list[int]]:
    """Each NUMA node's CPUs (its cpulist), made what a profile takes: every CPU in
    exactly one node. A CPU listed again stays in its first node, a CPU in none goes to
    the first node, and a listed CPU the profile does not have is dropped; each is said."""
    owner: dict[int, int] = {}
    lists: list[list[int]] = []
    unknown: set[int] = set()
    again: set[int] = set()
    for k, nid in enumerate(node_ids):
        mine: list[int] = []
        for c in _cpulist(root.line(f"{NODE_DIR}/node{nid}/cpulist")):
            if c >= ncpus:
                unknown.add(c)
            elif c in owner:
                again.add(c)
            else:
                owner[c] = k
                mine.append(c)
        lists.append(mine)
    nowhere = [c for c in range(ncpus) if c not in owner]
    lists[0] = sorted(lists[0] + nowhere)
    if unknown:
        left_out.append(f"NUMA node cpulists name CPUs {format_cpulist(unknown)}, which the "
                        f"profile's {ncpus} CPUs do not include: left out")
    if again:
        left_out.append(f"CPUs {format_cpulist(again)} are in more than one NUMA node's "
                        "cpulist: kept in the first")
    if nowhere:
        left_out.append(f"CPUs {format_cpulist(nowhere)} are in no NUMA node's cpulist: "
                        f"placed on NUMA node {node_ids[0]}")
    return lists



def read_swap(root: Root) -> str | None:
    """The swap size: SwapTotal counts every swap area but its header page (4 KiB)."""
    kb = _meminfo_kb(root.read("proc/meminfo"), "SwapTotal")
    if not kb:
        return None
    areas = max(1, len((root.read("proc/swaps") or "").strip().splitlines()) - 1)
    if (kb + 4 * areas) * 1024 > MAX_QUANTITY:
        raise CaptureError(f"{root.where}: proc/meminfo: SwapTotal {kb} kB; a profile holds "
                           f"at most {quantity(MAX_QUANTITY)} there")
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
        row = [decimal(x) for x in (root.line(f"{NODE_DIR}/node{nid}/distance") or "").split()]
        if len(row) != count or None in row:
            return None
        matrix.append([x or 0 for x in row])
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
