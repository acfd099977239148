"""How long `sandbox up --runtime local` takes at 8 to 1,000 GPUs, against Python's start-up.

For each size in --gpus, a generated one-node profile (benchmarks/_profiles.py, the node
bench_scale serves: 2 NUMA nodes, one PCI host bridge per 128 H100s) is brought up with
`sandbox up PROFILE --runtime local` and taken down with `sandbox down`, --repeat times,
in a throwaway state dir; each --profile given is measured the same way. `up` returns
once the kubelet harness sees every GPU advertised by the reference plugin (its
"advertised" step), so its wall time is the time to ready. The baseline is starting the
interpreter and importing nothing (`python -c pass`), measured in the same run; ratios
are against it. For the largest sandbox, the median run's progress lines (`up` prints
each step with the seconds since it started) show where the time goes. Target (issue
28): `up` <= 2 s median at 1,000 GPUs and <= 1 s at 8.

    python benchmarks/bench_up.py [--gpus 8,64,256,1000] [--repeat 5] [--profile PATH]...
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _profiles import gpu_profile

from sandbox.profile import load_profile

TARGETS = {8: 1.0, 1000: 2.0}  # GPUs -> seconds, median of the runs
_PROGRESS = re.compile(r"^\s*\[\s*([0-9.]+)s\] (.*)$")


@dataclass
class Row:
    name: str
    ups: list[float] = field(default_factory=list)
    downs: list[float] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)  # up's stderr per run (progress lines)


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{result.stderr}")
    return elapsed, result.stderr


def measure(name: str, profile: Path, repeat: int, env: dict[str, str]) -> Row:
    py = [sys.executable, "-m", "sandbox"]
    row = Row(name)
    for _ in range(repeat):
        up, log = timed([*py, "up", str(profile), "--runtime", "local"], env)
        row.ups.append(up)
        row.logs.append(log)
        row.downs.append(timed([*py, "down", "--name", _name(profile)], env)[0])
    return row


def _name(profile: Path) -> str:
    return load_profile(profile).cluster.name


def phases(log: str) -> list[tuple[float, str]]:
    return [(float(m[1]), m[2]) for line in log.splitlines() if (m := _PROGRESS.match(line))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="8,64,256,1000",
                        help="comma-separated GPU counts ('' for none)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", action="append", default=[],
                        help="also measure this profile (repeatable)")  # fmt: skip
    args = parser.parse_args()
    sizes = [int(x) for x in args.gpus.split(",") if x.strip()]
    work = Path(tempfile.mkdtemp(prefix="bench-up-", dir="/tmp"))
    env = {**os.environ, "HWSANDBOX_STATE_DIR": str(work / "state")}
    targets: list[tuple[str, Path]] = []
    for n in sizes:
        path = work / f"scale-{n}.yaml"
        path.write_text(gpu_profile(n))
        targets.append((f"{n} GPUs", path))
    targets += [(Path(p).name, Path(p).resolve()) for p in args.profile]
    try:
        base = [timed([sys.executable, "-c", "pass"], env)[0] for _ in range(args.repeat)]
        rows = []
        for name, path in targets:
            rows.append(measure(name, path, args.repeat, env))
            print(f"  measured {name}: up median {statistics.median(rows[-1].ups):.2f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    b = statistics.median(base)
    load = os.getloadavg()[0]
    print(f"\n{args.repeat} runs each; baseline `python -c pass` median {b * 1e3:.0f} ms; "
          f"load average {load:.1f} at the end\n")
    head = (f"{'sandbox':<22}{'up median s':>12}{'up max s':>10}{'x baseline':>12}"
            f"{'down median s':>15}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        up = statistics.median(r.ups)
        print(f"{r.name:<22}{up:>12.2f}{max(r.ups):>10.2f}{up / b:>12.1f}"
              f"{statistics.median(r.downs):>15.2f}")
    if rows:
        big = rows[len(sizes) - 1] if sizes else rows[-1]
        median_run = sorted(range(len(big.ups)), key=lambda i: big.ups[i])[len(big.ups) // 2]
        print(f"\n{big.name}: where the median run's {big.ups[median_run]:.2f} s went "
              "(seconds since `up` started, as it prints them)")
        for at, message in phases(big.logs[median_run]):
            print(f"  {at:5.1f} s  {message}")
    if TARGETS.keys() & set(sizes):
        print()
    for n, r in zip(sizes, rows, strict=False):
        if n in TARGETS:
            up = statistics.median(r.ups)
            verdict = "meets" if up <= TARGETS[n] else "MISSES"
            print(f"up at {n} GPUs {verdict} the {TARGETS[n]:.0f} s target (median of "
                  f"{args.repeat}: {up:.2f} s, worst {max(r.ups):.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
