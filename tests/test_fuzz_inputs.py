"""Fuzz: 10,000 mutated profiles and 2,000 mutated scenarios through the whole input path.

Each batch runs ``tests/fuzz_inputs.py`` in a subprocess that limits its own address
space (2 GiB, RLIMIT_AS) and stops any example after 30 s, with a time limit on the
batch, as a user's ``sandbox`` process would meet the input: only ``ProfileError`` /
``ScenarioError`` may come out, every profile problem located. Two batches run at a time
(CI machines have 2 cores). A failure prints the seed and index that replay it:
``python -m tests.fuzz_inputs profile SEED COUNT``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROFILES = int(os.environ.get("HWSANDBOX_FUZZ_PROFILES", "10000"))
SCENARIOS = int(os.environ.get("HWSANDBOX_FUZZ_SCENARIOS", "2000"))
BATCHES = 4
MEMORY_LIMIT = 2 << 30
BATCH_TIMEOUT = 900


def _batch(kind: str, seed: int, count: int) -> tuple[list[dict[str, object]], int]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fuzz_inputs", kind, str(seed), str(count),
         str(MEMORY_LIMIT)],
        cwd=REPO, capture_output=True, text=True, timeout=BATCH_TIMEOUT, check=False)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    done = sum(int(r["done"]) for r in records if "done" in r)  # type: ignore[call-overload]
    failures = [r for r in records if "error" in r]
    if proc.returncode != 0:
        failures.append({"kind": kind, "seed": seed, "error": f"batch exited "
                         f"{proc.returncode}: {proc.stderr[-2000:]}"})
    return failures, done


def _run(kind: str, total: int, batches: int) -> None:
    per = total // batches
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda s: _batch(kind, s, per), range(1, batches + 1)))
    failures = [f for fs, _ in results for f in fs]
    done = sum(d for _, d in results)
    shown = "\n".join(json.dumps(f)[:1500] for f in failures[:5])
    assert not failures, f"{len(failures)} {kind}(s) broke the loader:\n{shown}"
    assert done == per * batches


def test_mutated_profiles_give_only_located_profile_errors() -> None:
    _run("profile", PROFILES, BATCHES)


def test_mutated_scenarios_give_only_scenario_errors() -> None:
    _run("scenario", SCENARIOS, 2)
