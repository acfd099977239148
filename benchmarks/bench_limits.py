"""Whether the profile limits hold: tree memory linear in CPUs, the largest node servable.

1. Tree memory per entry (tracemalloc) for nodes of 64 to 16,384 logical CPUs (past the
   1,024 a profile may have: the limit is lifted here only to measure the scaling). The
   ratio largest/smallest should stay near 1 (it was 3.7x when CPU masks were copied
   per CPU, i.e. memory quadratic in CPUs).
2. The largest node the schema accepts (1,024 CPUs, 64 NUMA nodes, 1,024 devices, 2,048
   PCI functions: each at ``limits``' maximum, checked, and one VF more is refused):
   ``sandbox render`` into tmpfs (/dev/shm: the host's disk is not what is measured) in
   a subprocess, wall time and peak RSS, against the targets (10 s, 1 GiB) and against
   rendering the demo node (the baseline measured in the same run).

    python benchmarks/bench_limits.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from sandbox.errors import ProfileError
from sandbox.fakehw.builder import build_tree
from sandbox.profile import NodeSpec, load_profile_text
from sandbox.profile.resolve import limits

REPO = Path(__file__).resolve().parent.parent
TARGET_SECONDS = 10.0
TARGET_RSS = 1 << 30


def cpu_profile(ncpus: int) -> str:
    sockets = 16 if ncpus >= 16384 else 8 if ncpus >= 64 else 1
    return (
        "apiVersion: hwsandbox.dev/v1alpha1\nkind: HardwareProfile\nmetadata: {name: cpus}\n"
        "nodes:\n  - name: n\n"
        f"    cpu: {{sockets: {sockets}, coresPerSocket: {ncpus // sockets // 2}, "
        "threadsPerCore: 2}\n"
    )


NUMA = 64  # NUMA nodes of the largest node: the model's maximum (model.MAX_NUMA_NODES)


def largest_profile(extra_vfs: int = 0) -> str:
    """The largest node the limits allow: ``limits.MAX_CPUS`` CPUs over 64 NUMA nodes,
    ``limits.MAX_DEVICES`` devices (half H100s, half dual-port ConnectX-6) and exactly
    ``limits.MAX_FUNCTIONS`` PCI functions (every NIC port's SR-IOV VFs enabled, the VF
    budget spread over the ports). ``extra_vfs`` more VFs on each port of one NIC take it
    past the functions limit."""
    per_numa = limits.MAX_CPUS // NUMA
    half = per_numa // 2
    threads = limits.MAX_CPUS // 2
    gpus = nics = limits.MAX_DEVICES // NUMA // 2  # per NUMA node
    vfs = limits.MAX_FUNCTIONS // NUMA - gpus - 2 * nics  # per NUMA node, over 2 * nics PFs
    base, rest = divmod(vfs, 2 * nics)
    assert rest % 2 == 0, "the VF budget must split over whole dual-port cards"
    lines = [
        "apiVersion: hwsandbox.dev/v1alpha1", "kind: HardwareProfile",
        "metadata: {name: largest}", "nodes:", "  - name: big",
        f"    cpu: {{sockets: 16, coresPerSocket: {threads // 16}, threadsPerCore: 2}}",
        "    memory: 64Ti",
        "    numa:", "      nodes:",
    ]
    lines += [f"        - {{id: {k}, cpus: '{k * half}-{(k + 1) * half - 1},"
              f"{threads + k * half}-{threads + (k + 1) * half - 1}'}}" for k in range(NUMA)]
    lines += ["    pci:", "      hostBridges:"]
    lines += [f"        - {{domain: {d}, bus: 0, numaNode: {d}}}" for d in range(NUMA)]
    lines.append("    devices:")
    for k in range(NUMA):
        for group, (count, per_port) in enumerate(((rest // 2, base + 1),
                                                   (nics - rest // 2, base))):
            if k == group == 0 and extra_vfs:
                lines.append(f"      - {{type: nic, vendor: mellanox, model: connectx-6, "
                             f"ports: 2, numaNode: 0, sriov: {{totalVFs: {per_port + extra_vfs}, "
                             f"numVFs: {per_port + extra_vfs}}}}}")
                count -= 1
            if count:
                lines.append(f"      - {{type: nic, vendor: mellanox, model: connectx-6, "
                             f"count: {count}, ports: 2, numaNode: {k}, "
                             f"sriov: {{totalVFs: {per_port}, numVFs: {per_port}}}}}")
        lines.append(f"      - {{type: gpu, vendor: nvidia, model: h100-sxm5-80gb, "
                     f"count: {gpus}, numaNode: {k}}}")
    return "\n".join(lines) + "\n"


def functions(node: NodeSpec) -> int:
    """PCI functions of a resolved node, counted as the resolver's limit counts them."""
    total = 0
    for d in node.devices:
        total += len(d.functions)
        if d.gpu is not None:
            total += len(d.gpu.vf_addresses)
        if d.nic is not None:
            total += sum(len(v) for v in d.nic.vf_addresses)
    return total


def check_largest() -> str:
    """The largest profile is at every limit, and one VF more per port is refused."""
    node = load_profile_text(largest_profile()).cluster.nodes[0]
    got = (len(node.cpus), len(node.devices), functions(node))
    want = (limits.MAX_CPUS, limits.MAX_DEVICES, limits.MAX_FUNCTIONS)
    assert got == want, f"largest profile has (CPUs, devices, functions) {got}, not {want}"
    try:
        load_profile_text(largest_profile(extra_vfs=1))
        refused = "accepted"
    except ProfileError as exc:
        refused = str(exc)
    if "PCI functions on one node" not in refused:
        raise AssertionError(f"one VF past the largest profile: {refused}")
    return (f"{got[0]:,} CPUs, {NUMA} NUMA nodes, {got[1]:,} devices, {got[2]:,} PCI "
            "functions (one VF more on a NIC's ports is refused)")


def memory_per_entry(ncpus: int) -> tuple[int, float]:
    spec = load_profile_text(cpu_profile(ncpus)).cluster.nodes[0]
    gc.collect()
    tracemalloc.start()
    tree = build_tree(spec)
    used, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    entries = sum(1 for _ in tree.walk())
    return entries, used / entries


# The render's own peak: its VmHWM read at its exit. (RUSAGE_CHILDREN's ru_maxrss would
# count this benchmark's memory too: a child's high-water mark starts from the parent's
# RSS at fork, and the trees measured above make that hundreds of MiB.)
_RENDER = """
import sys
from sandbox.cli import main
try:
    code = main(sys.argv[1:])
finally:
    with open("/proc/self/status") as fh:
        hwm = next(line.split()[1] for line in fh if line.startswith("VmHWM:"))
    print(f"VmHWM {hwm}", file=sys.stderr)
sys.exit(code)
"""


def render_in_subprocess(profile_text: str, node: str, workdir: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `sandbox render` of one node, a fresh process."""
    profile = workdir / "profile.yaml"
    profile.write_text(profile_text)
    out = workdir / "out"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _RENDER, "render", str(profile), "--node",
                           node, "--out", str(out)], check=True, capture_output=True,
                          text=True, cwd=REPO)  # fmt: skip
    elapsed = time.perf_counter() - start
    hwm = next(int(line.split()[1]) for line in proc.stderr.splitlines()
               if line.startswith("VmHWM "))  # fmt: skip
    shutil.rmtree(out)
    return elapsed, hwm * 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU counts up to 4,096 only")
    args = ap.parse_args()
    counts = [64, 256, 1024, 2048, 4096] + ([] if args.quick else [8192, 16384])
    limit = limits.MAX_CPUS
    limits.MAX_CPUS = max(counts)  # measure past the limit, see the docstring
    print(f"{'CPUs':>6} {'entries':>9} {'bytes/entry':>12}")
    per_entry = []
    for n in counts:
        entries, bpe = memory_per_entry(n)
        per_entry.append(bpe)
        print(f"{n:>6} {entries:>9} {bpe:>12.0f}")
    ratio = per_entry[-1] / per_entry[0]
    print(f"bytes/entry {counts[-1]} vs {counts[0]} CPUs: {ratio:.2f}x (linear: ~1)")
    limits.MAX_CPUS = limit
    print(f"largest accepted node: {check_largest()}")
    demo = (REPO / "profiles" / "8gpu-2numa.yaml").read_text()
    with tempfile.TemporaryDirectory(prefix="bench-limits-", dir="/dev/shm") as tmp:
        base_s, _ = render_in_subprocess(demo, "gpu-worker", Path(tmp))
        big_s, big_rss = render_in_subprocess(largest_profile(), "big", Path(tmp))
    ok = big_s <= TARGET_SECONDS and big_rss <= TARGET_RSS
    print(f"render demo node: {base_s:.2f}s (baseline)")
    print(f"render largest accepted node: {big_s:.2f}s ({big_s / base_s:.1f}x the demo), "
          f"peak RSS {big_rss / 2**20:.0f} MiB; targets {TARGET_SECONDS:.0f}s, "
          f"{TARGET_RSS / 2**20:.0f} MiB: {'ok' if ok else 'MISSED'}")
    return 0 if ok and ratio < 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
