"""Fuzz: 10,000 mutated profiles and 2,000 mutated scenarios through the whole input path.

Each example runs in a child process of its own (``tests/support/fuzz_inputs.py`` forks one per
example from a warm batch process), which limits its address space (2 GiB, RLIMIT_AS),
its CPU time (RLIMIT_CPU) and its wall time (an alarm), while the batch waits for it with
a deadline: as a user's ``sandbox`` process would meet the input, only ``ProfileError`` /
``ScenarioError`` may come out, every problem located (``file:line:col``). A child that
crashed, hung or raised anything else fails the test with its seed and index. Two
batches run at a time (CI machines have 2 cores). Replay a failure with
``python -m tests.support.fuzz_inputs profile SEED COUNT``.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.fuzz_inputs import check_profile, run_limited
from tests.support.paths import REPO

pytestmark = pytest.mark.cpu_bound  # scripts/test runs these beside the e2e envs

PROFILES = int(os.environ.get("HWSANDBOX_FUZZ_PROFILES", "10000"))
SCENARIOS = int(os.environ.get("HWSANDBOX_FUZZ_SCENARIOS", "2000"))
BATCHES = 2  # one per core: each batch forks its examples one after another
MEMORY_LIMIT = 2 << 30
BATCH_TIMEOUT = 900


def _batch(kind: str, seed: int, count: int) -> tuple[list[dict[str, object]], int]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.fuzz_inputs", kind, str(seed), str(count),
         str(MEMORY_LIMIT)],
        cwd=REPO, capture_output=True, text=True, timeout=BATCH_TIMEOUT, check=False)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    done = sum(int(str(r["done"])) for r in records if "done" in r)
    failures = [r for r in records if "error" in r]
    if proc.returncode != 0:
        failures.append({"kind": kind, "seed": seed, "error": f"batch exited "
                         f"{proc.returncode}: {proc.stderr[-2000:]}"})
    return failures, done


def _run(kind: str, total: int) -> None:
    per = -(-total // BATCHES)
    with ThreadPoolExecutor(max_workers=BATCHES) as pool:
        results = list(pool.map(lambda s: _batch(kind, s, per), range(1, BATCHES + 1)))
    failures = [f for fs, _ in results for f in fs]
    done = sum(d for _, d in results)
    shown = "\n".join(json.dumps(f)[:1500] for f in failures[:5])
    assert not failures, f"{len(failures)} {kind}(s) broke the loader:\n{shown}"
    assert done >= total, f"only {done} of {total} {kind}s ran"


def test_mutated_profiles_give_only_located_profile_errors() -> None:
    _run("profile", PROFILES)


def test_mutated_scenarios_give_only_located_scenario_errors() -> None:
    _run("scenario", SCENARIOS)


def _raise() -> None:
    raise KeyError("boom")


def _spin() -> None:
    while True:
        pass


def _sleep() -> None:
    time.sleep(30)


def _ignore_the_alarm_and_sleep() -> None:
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(60)


def test_each_case_runs_limited_and_every_way_to_break_is_reported() -> None:
    """The harness itself: a clean case, a verdict, an exception, and each way a child
    can die (memory, CPU, segfault, alarm, past the deadline) come back as failures."""
    assert run_limited(lambda: None) is None
    assert run_limited(lambda: "wrong") == "wrong"
    assert "KeyError: 'boom'" in str(run_limited(_raise))
    assert "MemoryError" in str(run_limited(lambda: str(bytearray(1 << 30)), memory=256 << 20))
    assert "killed by SIGSEGV" in str(run_limited(lambda: str(ctypes.string_at(0))))
    assert "killed by SIGXCPU (more than 1 s of CPU)" in str(run_limited(_spin, cpu_seconds=1))
    assert "TimeoutError" in str(run_limited(_sleep, wall_seconds=1))
    assert "hung: no exit within 2 s" in str(
        run_limited(_ignore_the_alarm_and_sleep, wall_seconds=1, grace=1))


HUGE_CPULISTS = """apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: t}
nodes:
  - name: cpulist
    numa:
      nodes:
        - {id: 0, cpus: "0-300000000"}
        - {id: 1, cpus: "0-999999999999"}
"""


def test_huge_cpulists_fail_fast_and_located() -> None:
    """``0-300000000`` took 27 s and 4 GB before it failed: now a located error within a
    CPU-time limit (1 s, 256 MiB) that the old expansion could never meet."""
    verdict = run_limited(lambda: check_profile(HUGE_CPULISTS, "huge.yaml"),
                          cpu_seconds=1, memory=256 << 20)
    assert verdict is None, verdict

    def messages() -> str | None:
        from sandbox.errors import ProfileError
        from sandbox.profile import load_profile_text

        try:
            load_profile_text(HUGE_CPULISTS, "huge.yaml")
        except ProfileError as exc:
            return str(exc)
        return None

    assert run_limited(messages, cpu_seconds=1, memory=256 << 20) == (
        "huge.yaml:8:25: nodes[0].numa.nodes[0].cpus: CPU 4 does not exist (have 0-3)\n"
        "huge.yaml:9:25: nodes[0].numa.nodes[1].cpus: '0-999999999999': CPU number too large")
