"""How fast ``build_tree`` is, and how big its trees are, against plain tmpfs as baseline.

For the demo node (profiles/8gpu-2numa.yaml) and a generated 1,000-device node (NVIDIA,
AMD and Intel GPUs, RDMA NICs with SR-IOV, DFL FPGAs and generic devices spread over
eight PCI host bridges in eight PCI domains), print: build time (best of N), the tree's
entry count and memory (tracemalloc), a rebuild after one device's state changes, and the
time to write the same tree to tmpfs (``render`` into /dev/shm) as the baseline ratio.
The target is a 1,000-device build within 1 s (the live server rebuilds on every change).

    python benchmarks/bench_tree.py [--repeat N]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.fakehw.tree import DeviceState, Health, Reason
from sandbox.profile import load_profile, load_profile_text
from sandbox.profile.spec import NodeSpec

REPO = Path(__file__).resolve().parent.parent
TARGET_1000 = 1.0  # seconds


def generated_profile(devices: int = 1000) -> str:
    """A profile text with ``devices`` devices on one 4-NUMA-node, 8-host-bridge node."""
    share = {  # fraction of the devices of each kind
        "nvidia": 0.30, "amd": 0.10, "intel": 0.10, "nic": 0.30, "fpga": 0.10, "generic": 0.10,
    }
    counts = {k: int(devices * v) for k, v in share.items()}
    counts["generic"] += devices - sum(counts.values())
    lines = [
        "apiVersion: hwsandbox.dev/v1alpha1",
        "kind: HardwareProfile",
        "metadata: {name: bench-1000}",
        "nodes:",
        "  - name: big",
        "    cpu: {sockets: 2, coresPerSocket: 32, threadsPerCore: 2}",
        "    memory: 2Ti",
        "    numa:",
        "      nodes: [{id: 0}, {id: 1}, {id: 2}, {id: 3}]",
        "    pci:",
        "      hostBridges:",
    ]
    lines += [f"        - {{domain: {d}, bus: 0, numaNode: {d % 4}}}" for d in range(8)]
    lines.append("    devices:")

    def spread(kind: str, body: str) -> None:
        n = counts[kind]
        for numa in range(4):
            c = n // 4 + (1 if numa < n % 4 else 0)
            if c:
                lines.append(f"      - {{{body}, count: {c}, numaNode: {numa}}}")

    spread("nvidia", "type: gpu, vendor: nvidia, model: h100-sxm5-80gb")
    spread("amd", "type: gpu, vendor: amd, model: mi300x")
    spread("intel", "type: gpu, vendor: intel, model: flex-170")
    spread("nic", "type: nic, vendor: mellanox, model: connectx-7, "
                  "sriov: {totalVFs: 2, numVFs: 2}")
    spread("fpga", "type: fpga, vendor: intel, model: pac-a10")
    spread("generic", "type: generic, name: acc, vendorId: 0x1d0f, deviceId: 0xcd01, "
                      "classCode: 0x120000, driver: vfio-pci")
    return "\n".join(lines) + "\n"


def _best(fn: object, repeat: int) -> float:
    assert callable(fn)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(label: str, node: NodeSpec, repeat: int) -> dict[str, object]:
    build_tree(node)  # warm
    build_s = _best(lambda: build_tree(node), repeat)
    gc.collect()
    tracemalloc.start()
    tree = build_tree(node)
    mem, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    entries = sum(1 for _ in tree.walk())
    first = node.devices[0].id if node.devices else None
    states = {first: DeviceState(Health.UNHEALTHY, Reason.AER_FATAL)} if first else {}
    rebuild_s = _best(lambda: build_tree(node, states), repeat)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    render_s = float("inf")
    for _ in range(max(1, repeat // 3)):
        out = Path(tempfile.mkdtemp(prefix="bench-tree-", dir=shm))
        try:
            t = time.perf_counter()
            render(tree, out / "root")
            render_s = min(render_s, time.perf_counter() - t)
        finally:
            shutil.rmtree(out)
    return {
        "node": label, "devices": len(node.devices), "entries": entries,
        "build_ms": build_s * 1e3, "rebuild_ms": rebuild_s * 1e3, "mem_mib": mem / 2**20,
        "tmpfs_ms": render_s * 1e3, "ratio": build_s / render_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args(argv)
    demo = load_profile(REPO / "profiles" / "8gpu-2numa.yaml").cluster.nodes[0]
    big = load_profile_text(generated_profile(1000), "<bench-1000>").cluster.nodes[0]
    rows = [measure("8gpu-2numa", demo, args.repeat),
            measure("generated-1000", big, max(3, args.repeat // 3))]
    head = (f"{'node':<16}{'devices':>8}{'entries':>9}{'build ms':>10}{'rebuild ms':>11}"
            f"{'tree MiB':>9}{'tmpfs ms':>10}{'build/tmpfs':>12}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['node']:<16}{r['devices']:>8}{r['entries']:>9}{r['build_ms']:>10.1f}"
              f"{r['rebuild_ms']:>11.1f}{r['mem_mib']:>9.1f}{r['tmpfs_ms']:>10.1f}"
              f"{r['ratio']:>12.2f}")
    big_s = float(str(rows[1]["build_ms"])) / 1e3
    verdict = "meets" if big_s <= TARGET_1000 else "MISSES"
    print(f"\n1,000-device build: {big_s:.3f} s ({verdict} the {TARGET_1000:.0f} s target)")
    return 0 if big_s <= TARGET_1000 else 1


if __name__ == "__main__":
    sys.exit(main())
