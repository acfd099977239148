"""Property: whatever the document, the loader returns a profile or raises ProfileError;
and what it returns builds.

``test_mixed_vendor_profiles_build_or_give_located_errors`` owns a fixed set of 15,000
mutated profiles (``HWSANDBOX_MIXED_FUZZ``; its seed ``HWSANDBOX_MIXED_FUZZ_SEED``,
default 1) from ``tests/support/fuzz_inputs.py``'s ``mixed_case``: device entries of every kind,
vendor and catalogue model next to each other (DFL and Xilinx FPGAs, NVIDIA, AMD and Intel
GPUs, Mellanox and Intel NICs, NVMe drives, generic devices), entries duplicated, moved,
re-vendored and re-counted, and half the time values edited near their limits. Each must
either give only located ProfileErrors (``file:line:col: path: message``) or load and
build every node with the real builder; every 50th that builds is rendered to disk too
(tmpfs where there is one). Anything else is a failure naming its index.

The set is spread over runs: one run takes every third case, share ``k`` = cases
``k, k + 3, k + 6, ...`` with ``k`` the UTC day's ordinal mod 3, so any three consecutive
days run all 15,000 (``HWSANDBOX_MIXED_FUZZ_SHARE=k`` picks a share,
``HWSANDBOX_MIXED_FUZZ_SHARES=1`` runs the whole set at once). All 15,000 in one run took
~160 s of CPU here, ~80 s on an idle 2-core machine: too long for every run of the suite;
a share takes a third. The cases run in process, split over two forked workers (one per
CI core). Replay a case in a limited child with ``python -m tests.support.fuzz_inputs mixed SEED
INDEX+1`` (it runs cases 0..INDEX).
"""

from __future__ import annotations

import copy
import datetime
import multiprocessing
import os
import shutil
import signal
import tempfile
import traceback
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox.errors import ProfileError
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.profile import load_profile_text
from tests.support.fuzz_devices import catalogue_device
from tests.support.fuzz_inputs import (
    mixed_case,
    seed_profiles,
    unlocated,
)
from tests.support.paths import REPO as ROOT

pytestmark = pytest.mark.cpu_bound  # scripts/test runs these beside the e2e envs

SEEDS = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "profiles").glob("*.yaml"))]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["0x10de", "80Gi", "-1", "gpu", "nic", "0-3,9", ""]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated_profiles(draw: st.DrawFn) -> str:
    doc = copy.deepcopy(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "delete", "add", "dup", "device"]))
        if action == "device":  # a catalogue device of any kind and vendor, anywhere
            nodes = doc.get("nodes") if isinstance(doc, dict) else None
            node = draw(st.sampled_from(nodes)) if isinstance(nodes, list) and nodes else None
            devices = node.setdefault("devices", []) if isinstance(node, dict) else None
            if isinstance(devices, list):
                devices.insert(draw(st.integers(0, len(devices))),
                               catalogue_device(draw(st.randoms(use_true_random=False))))
            continue
        if not path:
            doc = draw(values) if action == "replace" else doc
            continue
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        key = path[-1]
        if action == "replace":
            parent[key] = draw(values)
        elif action == "delete":
            del parent[key]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=10))] = draw(values)
        elif action == "dup" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
    return yaml.safe_dump(doc, sort_keys=False)


raw_text = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    st.sampled_from(["a: &x [*x]", "- - - - -", "? [a]\n: b", "!!python/object:os.system {}",
                     "a: !!binary AAAA", "{" * 80, "a: 1\n---\nb: 2"]),
)


def _problems(text: str) -> list[object]:
    """The problems the loader reports; any exception but ProfileError fails the test."""
    try:
        load_profile_text(text, "fuzz.yaml")
    except ProfileError as exc:
        problems: list[object] = list(exc.problems)
        if not problems:
            raise AssertionError("ProfileError without problems") from exc
        return problems
    return []


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_profiles())
def test_mutated_profiles_only_raise_profile_error(text: str) -> None:
    problems = _problems(text)
    assert all(str(p).startswith("fuzz.yaml:") for p in problems)


@settings(max_examples=500, deadline=None)
@given(raw_text)
def test_arbitrary_text_only_raises_profile_error(text: str) -> None:
    _problems(text)


MIXED = int(os.environ.get("HWSANDBOX_MIXED_FUZZ", "15000"))  # the whole fixed set
MIXED_SEED = int(os.environ.get("HWSANDBOX_MIXED_FUZZ_SEED", "1"))
SHARES = max(1, int(os.environ.get("HWSANDBOX_MIXED_FUZZ_SHARES", "3")))  # runs it spans
SHARE = int(os.environ.get("HWSANDBOX_MIXED_FUZZ_SHARE",
                           str(datetime.datetime.now(datetime.UTC).toordinal()))) % SHARES
CASES = range(SHARE, MIXED, SHARES)  # this run's share of the set
WORKERS = 2  # CI machines have 2 cores
RENDER_EVERY = 50  # of the profiles that build, every 50th is rendered to disk too
CASE_SECONDS = 60  # one case past this is a failure (a hang), not a stuck test
SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # tmpfs: renders fast


def _timeout(_signum: int, _frame: Any) -> None:
    raise TimeoutError(f"one case took more than {CASE_SECONDS} s")


def _mixed_share(worker: int) -> dict[str, Any]:
    """This worker's cases of the run's share: counts, and the failures."""
    seeds = seed_profiles()
    counts = {"refused": 0, "built": 0, "rendered": 0}
    failures: list[str] = []
    scratch = Path(tempfile.mkdtemp(prefix="mixed-fuzz-", dir=SCRATCH))
    signal.signal(signal.SIGALRM, _timeout)
    try:
        for i in CASES[worker::WORKERS]:
            text = mixed_case(MIXED_SEED, i, seeds)
            name = f"mixed-{MIXED_SEED}-{i}.yaml"
            signal.alarm(CASE_SECONDS)
            try:
                try:
                    cluster = load_profile_text(text, name).cluster
                except ProfileError as exc:
                    counts["refused"] += 1
                    wrong = unlocated(exc, text, name)
                    if wrong:
                        failures.append(f"case {i}: {wrong}\n{text[:1500]}")
                    continue
                out = scratch / str(i) if counts["built"] % RENDER_EVERY == 0 else None
                for node in cluster.nodes:
                    tree = build_tree(node)
                    if out is not None:
                        render(tree, out / node.name)
                if out is not None:
                    shutil.rmtree(out)
                    counts["rendered"] += 1
                counts["built"] += 1
            except Exception as exc:  # noqa: BLE001 - anything but a located error is a bug
                failures.append(f"case {i}: {''.join(traceback.format_exception(exc))[-2500:]}"
                                f"\n{text[:1500]}")
            finally:
                signal.alarm(0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {**counts, "failures": failures}


def test_mixed_vendor_profiles_build_or_give_located_errors() -> None:
    """See the module docstring: this run's share of the 15,000 mixed-vendor mutated
    profiles, zero exceptions but located ProfileErrors, and every profile that loads
    builds."""
    with multiprocessing.get_context("fork").Pool(WORKERS) as pool:
        shares = pool.map(_mixed_share, range(WORKERS))
    failures = [f for share in shares for f in share["failures"]]
    counts = {k: sum(share[k] for share in shares) for k in ("refused", "built", "rendered")}
    shown = "\n\n".join(failures[:3])
    assert not failures, (f"{len(failures)} of {len(CASES)} mixed-vendor profiles (share "
                          f"{SHARE} of {SHARES}, seed {MIXED_SEED}) broke:\n{shown}")
    assert counts["refused"] + counts["built"] == len(CASES), counts
    # The corpus must keep reaching the builder (where what validates breaks) and the
    # renderer, and keep giving errors too.
    assert counts["built"] >= len(CASES) // 4, counts
    assert counts["refused"] >= len(CASES) // 4, counts
    assert counts["rendered"] >= len(CASES) // (8 * RENDER_EVERY), counts
