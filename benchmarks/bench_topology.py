"""What the emulated topology costs `sandbox up` (issue 22): native and kind, with it and
without, in one run.

For each runtime in --runtimes, profiles/8gpu-2numa.yaml is brought up --repeat times
with `sandbox up --kubelet-topology emulated` (the default: each kubelet in a mount
namespace of its own on the node's tree, the static CPU manager, runc behind the cpuset
mapper; kind restarts each profile node's kubelet once the tree is served) and as many
times with `--kubelet-topology host` (the baseline: the kubelet sees this machine),
alternating, each taken down with `sandbox down`. The table gives the medians, the ratio
and the difference; the target is at most +1 s. Needs root; kind needs Docker and kind
(`eval "$(scripts/test-dockerd start)"`, and kind on PATH).

    python benchmarks/bench_topology.py [--runtimes native,kind] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "profiles" / "8gpu-2numa.yaml"
TARGET = 1.0  # seconds added at most


def timed_up(runtime: str, topology: str, env: dict[str, str]) -> float:
    py = [sys.executable, "-m", "sandbox"]
    name = f"bench-topo-{runtime}"
    start = time.perf_counter()
    up = subprocess.run([*py, "up", str(PROFILE), "--runtime", runtime, "--name", name,
                         "--kubelet-topology", topology], env=env, capture_output=True,
                        text=True, check=False)
    took = time.perf_counter() - start
    down = subprocess.run([*py, "down", "--name", name], env=env, capture_output=True,
                          text=True, check=False)
    if up.returncode != 0:
        raise SystemExit(f"sandbox up --runtime {runtime} --kubelet-topology {topology} "
                         f"failed:\n{up.stderr}")
    if down.returncode != 0:
        raise SystemExit(f"sandbox down --name {name} failed:\n{down.stderr}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtimes", default="native,kind")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hwsb-bench-topo-", dir="/tmp") as state:
        env = dict(os.environ, HWSANDBOX_STATE_DIR=state)
        for runtime in args.runtimes.split(","):
            times: dict[str, list[float]] = {"host": [], "emulated": []}
            for _ in range(args.repeat):
                for topology in ("host", "emulated"):  # alternating: drift hits both
                    times[topology].append(timed_up(runtime, topology, env))
            base, emulated = (statistics.median(times[t]) for t in ("host", "emulated"))
            rows.append((runtime, base, emulated))
    print(f"sandbox up {PROFILE.name}, median of {args.repeat} runs each "
          f"(baseline: --kubelet-topology host, same run)")
    print(f"{'RUNTIME':8} {'HOST s':>8} {'EMULATED s':>11} {'RATIO':>6} {'ADDED s':>8}  TARGET")
    ok = True
    for runtime, base, emulated in rows:
        added = emulated - base
        ok &= added <= TARGET
        verdict = "ok" if added <= TARGET else "MISSED"
        print(f"{runtime:8} {base:8.2f} {emulated:11.2f} {emulated / base:6.2f} {added:+8.2f}"
              f"  <= +{TARGET:.0f} s {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
