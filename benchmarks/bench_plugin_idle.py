"""The reference device plugin at scale: idle CPU and health flip latency on a live tree.

One node with ``--gpus`` NVIDIA GPUs (default 1,000) is mounted over FUSE (``sandbox
mount``); the plugin serves the kubelet harness (sandbox.kubelet.DeviceManager) from it.
Each mode runs the plugin as its own process and measures, while nothing changes, the
CPU the plugin and the FUSE server answering its reads burn (utime + stime from
/proc/PID/stat over ``--window`` seconds, as % of one core), then ``--flips`` health flips
sent through the control socket (as ``sandbox fault`` sends them): the time until the
harness sees allocatable drop, and until it is back.

    mode      the plugin
    baseline  ``plugins/hwplugins`` as of ``--baseline`` (git archive into a temp dir):
              buffered reads, a full rescan every --interval
    poll      this tree's plugin, a full rescan every --interval (no control socket)
    watch     this tree's plugin with --watch on the node's control socket: rescans on
              change events, a full resync every --resync seconds

"fault" is the control reply alone (the server rebuilding its tree): the part of a flip
no plugin can remove. Ratios are against the baseline measured in the same run. Targets
(issue 16): idle CPU of the whole sandbox <= 5 % of one core at 1,000 GPUs; health flip ->
ListAndWatch <= 1 s.

    python benchmarks/bench_plugin_idle.py [--gpus 1000] [--window 10] [--flips 5]
           [--baseline 592530c] [--modes baseline,poll,watch]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sandbox.agent import spawn_node, unmount, wait_unmounted
from sandbox.fakehw.control import ControlClient
from sandbox.kubelet import DeviceManager

os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # the harness's GOAWAY lines are noise here
REPO = Path(__file__).resolve().parent.parent
GPU = "nvidia.com/gpu"
TICKS = os.sysconf("SC_CLK_TCK")
CPU_TARGET = 5.0  # % of one core, the whole sandbox at idle
FLIP_TARGET = 1.0  # seconds


def profile_text(gpus: int) -> str:
    """One node, 4 NUMA nodes, ``gpus`` H100s spread over them and 8 host bridges."""
    lines = [
        "apiVersion: hwsandbox.dev/v1alpha1",
        "kind: HardwareProfile",
        f"metadata: {{name: bench-{gpus}-gpus}}",
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
    for numa in range(4):
        count = gpus // 4 + (1 if numa < gpus % 4 else 0)
        if count:
            lines.append(f"      - {{type: gpu, vendor: nvidia, model: h100-sxm5-80gb, "
                         f"count: {count}, numaNode: {numa}}}")  # fmt: skip
    return "\n".join(lines) + "\n"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:  # our own /proc, not the tree under test
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@dataclass
class Result:
    mode: str
    plugin_cpu: float  # % of one core
    server_cpu: float
    flips: list[float]
    recoveries: list[float]
    faults: list[float]  # the control reply alone: the server's rebuild, no plugin in it

    @property
    def total(self) -> float:
        return self.plugin_cpu + self.server_cpu


@contextmanager
def live_node(base: Path, gpus: int) -> Iterator[tuple[Path, Path, int]]:
    profile = base / "profile.yaml"
    profile.write_text(profile_text(gpus))
    root = base / "root"
    server = spawn_node(str(profile), "big", root, state_dir=base, log_file=base / "mount.log",
                        timeout=120)  # fmt: skip
    try:
        yield root, base / "control.sock", server.pid
    finally:
        unmount(root)
        wait_unmounted(root)


def baseline_tree(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "plugins/hwplugins"],
                             capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "plugins"


def run_mode(mode: str, args: argparse.Namespace, root: Path, sock: Path, server: int,
             gpu_ids: list[str], old_path: Path | None) -> Result:  # fmt: skip
    env = dict(os.environ)
    argv = [sys.executable, "-m", "hwplugins.deviceplugin", "--root", str(root),
            "--interval", str(args.interval)]  # fmt: skip
    if mode == "baseline":
        assert old_path is not None
        env["PYTHONPATH"] = str(old_path)
    elif mode == "watch":
        argv += ["--watch", str(sock), "--resync", str(args.resync)]
    sockdir = Path(tempfile.mkdtemp(prefix="bpi-", dir="/tmp"))
    try:
        with DeviceManager(sockdir, numa_nodes=[0, 1, 2, 3]) as dm:
            proc = subprocess.Popen([*argv, "--kubelet-dir", str(dm.directory)], env=env,
                                    stderr=subprocess.DEVNULL)  # fmt: skip
            try:
                dm.wait_for(lambda s: s.allocatable(GPU) == args.gpus, 120, "every GPU")
                time.sleep(args.settle)
                p0, s0, t0 = cpu_seconds(proc.pid), cpu_seconds(server), time.monotonic()
                time.sleep(args.window)
                p1, s1, t1 = cpu_seconds(proc.pid), cpu_seconds(server), time.monotonic()
                flips, back, faults = [], [], []
                with ControlClient(sock) as client:
                    for i in range(args.flips):
                        gpu = gpu_ids[(i * 37) % len(gpu_ids)]
                        time.sleep(0.137 * (i % 7) + 0.2)  # off the rescan phase
                        t = time.perf_counter()
                        client.health(gpu, "unhealthy", "aer-fatal")
                        faults.append(time.perf_counter() - t)
                        dm.wait_for(lambda s: s.allocatable(GPU) == args.gpus - 1, 60, "flip")
                        flips.append(time.perf_counter() - t)
                        t = time.perf_counter()
                        client.health(gpu, "healthy")
                        dm.wait_for(lambda s: s.allocatable(GPU) == args.gpus, 60, "recovery")
                        back.append(time.perf_counter() - t)
            finally:
                proc.terminate()
                proc.wait(30)
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)
    span = t1 - t0
    return Result(mode, 100 * (p1 - p0) / span, 100 * (s1 - s0) / span, flips, back, faults)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--window", type=float, default=10.0, help="idle seconds measured")
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--flips", type=int, default=5)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--resync", type=float, default=30.0)
    ap.add_argument("--baseline", default="592530c",
                    help="git revision of the baseline plugin (default: 592530c, before "
                    "the shared device model and the watch)")  # fmt: skip
    ap.add_argument("--modes", default="baseline,poll,watch")
    args = ap.parse_args()
    modes = args.modes.split(",")
    base = Path(tempfile.mkdtemp(prefix="bench-idle-", dir="/tmp"))
    results: list[Result] = []
    try:
        old = baseline_tree(args.baseline, base) if "baseline" in modes else None
        with live_node(base, args.gpus) as (root, sock, server):
            with ControlClient(sock) as client:
                gpu_ids = sorted(k for k, v in client.devices().items() if v["kind"] == "gpu")
            s0, t0 = cpu_seconds(server), time.monotonic()
            time.sleep(min(args.window, 5.0))
            floor = 100 * (cpu_seconds(server) - s0) / (time.monotonic() - t0)
            for mode in modes:
                results.append(run_mode(mode, args, root, sock, server, gpu_ids, old))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ref = results[0]
    print(f"{args.gpus} GPUs, idle window {args.window:.0f} s, rescan interval "
          f"{args.interval:.2f} s; FUSE server alone at idle: {floor:.2f} % of one core\n")
    print(f"{'mode':<10} {'plugin %':>9} {'server %':>9} {'total %':>8} {'x ' + ref.mode:>11} "
          f"{'fault p50 ms':>13} {'flip p50 ms':>12} {'flip max ms':>12} "
          f"{'back p50 ms':>12}")  # fmt: skip
    for r in results:
        ratio = r.total / ref.total if ref.total else float("nan")
        print(f"{r.mode:<10} {r.plugin_cpu:>9.2f} {r.server_cpu:>9.2f} {r.total:>8.2f} "
              f"{ratio:>11.3f} {statistics.median(r.faults) * 1e3:>13.0f} "
              f"{statistics.median(r.flips) * 1e3:>12.0f} "
              f"{max(r.flips) * 1e3:>12.0f} {statistics.median(r.recoveries) * 1e3:>12.0f}")
    best = results[-1]
    cpu_ok = best.total <= CPU_TARGET
    flip_ok = max(best.flips + best.recoveries) <= FLIP_TARGET
    print(f"\n{best.mode}: idle {best.total:.2f} % of one core "
          f"({'meets' if cpu_ok else 'MISSES'} the {CPU_TARGET:.0f} % target); worst flip "
          f"{max(best.flips + best.recoveries) * 1e3:.0f} ms "
          f"({'meets' if flip_ok else 'MISSES'} the {FLIP_TARGET:.0f} s target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
