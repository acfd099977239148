"""Whether the profile limits hold: tree memory linear in CPUs, the largest node servable.

1. Tree memory per entry (tracemalloc) for nodes of 64 to 16,384 logical CPUs (past the
   1,024 a profile may have: the limit is lifted here only to measure the scaling). The
   ratio largest/smallest should stay near 1 (it was 3.7x when CPU masks were copied
   per CPU, i.e. memory quadratic in CPUs).
2. The largest node the schema accepts (1,024 CPUs, 64 NUMA nodes, 1,024 devices, 3,584
   PCI functions): ``sandbox render`` into tmpfs (/dev/shm: the host's disk is not what
   is measured) in a subprocess, wall time and peak RSS, against the targets (10 s,
   1 GiB) and against rendering the demo node (the baseline measured in the same run).

    python benchmarks/bench_limits.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from sandbox.fakehw.build import build_tree
from sandbox.profile import load_profile_text
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


def largest_profile() -> str:
    """The largest node the limits allow: 1,024 CPUs over 64 NUMA nodes, 1,024 devices,
    3,584 PCI functions (NICs with SR-IOV VFs and RDMA, GPUs)."""
    per_numa = limits.MAX_CPUS // 64
    half = per_numa // 2
    threads = limits.MAX_CPUS // 2
    lines = [
        "apiVersion: hwsandbox.dev/v1alpha1", "kind: HardwareProfile",
        "metadata: {name: largest}", "nodes:", "  - name: big",
        f"    cpu: {{sockets: 16, coresPerSocket: {threads // 16}, threadsPerCore: 2}}",
        "    memory: 64Ti",
        "    numa:", "      nodes:",
    ]
    lines += [f"        - {{id: {k}, cpus: '{k * half}-{(k + 1) * half - 1},"
              f"{threads + k * half}-{threads + (k + 1) * half - 1}'}}" for k in range(64)]
    lines += ["    pci:", "      hostBridges:"]
    lines += [f"        - {{domain: {d}, bus: 0, numaNode: {d}}}" for d in range(64)]
    lines.append("    devices:")
    for k in range(64):
        lines.append(f"      - {{type: nic, vendor: mellanox, model: connectx-6, count: 8, "
                     f"ports: 2, numaNode: {k}, sriov: {{totalVFs: 2, numVFs: 2}}}}")
        lines.append(f"      - {{type: gpu, vendor: nvidia, model: h100-sxm5-80gb, count: 8, "
                     f"numaNode: {k}}}")
    return "\n".join(lines) + "\n"


def memory_per_entry(ncpus: int) -> tuple[int, float]:
    spec = load_profile_text(cpu_profile(ncpus)).cluster.nodes[0]
    gc.collect()
    tracemalloc.start()
    tree = build_tree(spec)
    used, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    entries = sum(1 for _ in tree.walk())
    return entries, used / entries


def render_in_subprocess(profile_text: str, node: str, workdir: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `sandbox render` of one node, a fresh process."""
    profile = workdir / "profile.yaml"
    profile.write_text(profile_text)
    out = workdir / "out"
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sandbox", "render", str(profile), "--node", node,
                    "--out", str(out)], check=True, capture_output=True, cwd=REPO)
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    shutil.rmtree(out)
    return elapsed, max(peak, before) * 1024


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
