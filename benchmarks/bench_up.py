"""How long `sandbox up` takes with the local runtime, against Python's own start-up.

Runs `sandbox up profiles/8gpu-2numa.yaml` + `sandbox down` N times in a throwaway state
dir and prints wall times next to the baseline (starting the interpreter and importing
nothing: `python -c pass`). The target is ready (every GPU advertised) within 3 s.

    python benchmarks/bench_up.py [--repeat N] [--profile PATH]
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = 3.0


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{result.stderr}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", default=str(REPO / "profiles" / "8gpu-2numa.yaml"))
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="hwsb-", dir="/tmp"))
    env = {**os.environ, "HWSANDBOX_STATE_DIR": str(state)}
    py = [sys.executable]
    try:
        base = [timed([*py, "-c", "pass"], env) for _ in range(args.repeat)]
        ups, downs = [], []
        for _ in range(args.repeat):
            ups.append(timed([*py, "-m", "sandbox", "up", args.profile, "--runtime", "local"],
                             env))
            downs.append(timed([*py, "-m", "sandbox", "down"], env))
    finally:
        shutil.rmtree(state, ignore_errors=True)
    b = statistics.median(base)
    rows = [("python -c pass (baseline)", base), ("sandbox up (ready)", ups),
            ("sandbox down", downs)]
    print(f"{'step':28} {'median s':>9} {'max s':>7} {'x baseline':>11}")
    for name, xs in rows:
        print(f"{name:28} {statistics.median(xs):9.2f} {max(xs):7.2f} "
              f"{statistics.median(xs) / b:11.1f}")
    verdict = "meets" if max(ups) <= TARGET else "MISSES"
    print(f"\nup {verdict} the {TARGET:.0f} s target (worst of {args.repeat}: {max(ups):.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
