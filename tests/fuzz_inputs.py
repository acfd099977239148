"""Structure-aware mutators for profiles and scenarios, and the batch runner the fuzz tests
start as a subprocess (under memory and time limits).

    python -m tests.fuzz_inputs profile|scenario SEED COUNT [ADDRESS-SPACE-BYTES]

Each example is drawn from ``random.Random(f"{kind}:{SEED}:{i}")`` (so a failure names
its seed and index and can be replayed), put through the whole path (profile: load ->
resolve -> build every node; scenario: parse -> expand), and judged: only the input error
type may escape, and every profile problem must carry a line and a column. One JSON line
per failure on stdout, then ``{"done": COUNT}``.
"""

from __future__ import annotations

import copy
import json
import random
import resource
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
PER_EXAMPLE_SECONDS = 30

# Numbers at and past every limit the model and resolver set, and the usual suspects.
NUMBERS: list[Any] = [
    0, 1, -1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 255, 256, 257, 511, 512, 513,
    1023, 1024, 1025, 4095, 4096, 4097, 65535, 65536, 2**31, 2**32, 2**63, 2**64, 10**30,
    -(2**63), 0.5, -0.0, 1e300, float("inf"), float("-inf"), float("nan"),
]
TEXTS: list[Any] = [
    "", ".", "..", "../x", "a/b", "/abs", "../../../../etc/passwd", "x\ny", "a=b", " ",
    "\t", "\u0000", "\u00e9", "gpu0", "nic0", "0x10de", "0xZZ", "80Gi", "1Pi", "2Pi",
    "99999999999999999999999Ti", "0-3,9", "0-999999999999", "3-1", "0-", "\u0663",
    "a" * 300, "{i}", "accel/accel{i}", "nvidia0", "nvidia0/x", "dri/card0", "null",
    "-", "x" * 64, "Worker", "healthy", "unhealthy", "aer-fatal", "removed",
]
SHAPES: list[Any] = [None, True, False, [], {}, [1], {"a": 1}, [[[]]], {"id": 0}]
HOSTILE_DEVICES: list[dict[str, Any]] = [
    {"type": "generic", "vendorId": "0x8086", "deviceId": "0x1", "classCode": "0x120000",
     "driver": "../../../../../victim/passwd",
     "devNodes": [{"name": "../escape", "major": 240, "minor": 0}]},
    {"type": "generic", "vendorId": 1, "deviceId": 2, "classCode": 3, "count": 3,
     "devNodes": [{"name": "accel/accel{i}", "major": 240, "minor": 0},
                  {"name": "accel", "major": 240, "minor": 9}]},
    {"type": "generic", "vendorId": 1, "deviceId": 2, "classCode": 3,
     "devNodes": [{"name": "nvidia0", "major": 195, "minor": 0}]},
    {"type": "gpu", "vendor": "nvidia", "model": "t4", "count": 1024},
    {"type": "nic", "vendor": "mellanox", "model": "connectx-6", "ports": 4, "count": 64,
     "sriov": {"totalVFs": 64, "numVFs": 64}},
]


def seed_profiles() -> list[Any]:
    return [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "profiles").glob("*.yaml"))]


def seed_scenarios() -> list[Any]:
    return [{
        "version": 1, "seed": 7,
        "steps": [
            {"at": 0.5, "do": "health", "device": "gpu0", "health": "unhealthy",
             "reason": "aer-fatal"},
            {"at": 1.0, "do": "unplug", "device": "nic0", "repeat": 3, "every": 2.0},
            {"at": 2.0, "do": "set-vfs", "device": "gpu1", "num_vfs": 4},
            {"at": 3.0, "do": "storm", "changes": 10, "over": 5.0,
             "devices": ["gpu0", "gpu1"], "ops": ["health", "unplug", "plug"]},
            {"at": 9.0, "expect": {"gpu0": {"plugged": True}, "gpu1": {"num_vfs": 4}}},
        ],
    }]


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def _value(rng: random.Random) -> Any:
    pick = rng.random()
    if pick < 0.45:
        return rng.choice(NUMBERS)
    if pick < 0.85:
        return rng.choice(TEXTS)
    return copy.deepcopy(rng.choice(SHAPES))


def mutate(doc: Any, rng: random.Random, keys: list[str]) -> Any:
    """1-4 structural edits: replace a value, drop or add a key, duplicate or nest."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 4)):
        paths = _paths(doc)
        path = rng.choice(paths)
        op = rng.randrange(8)
        if not path:
            if op == 0:
                return _value(rng)
            continue
        parent = _get(doc, path[:-1])
        key = path[-1]
        if op <= 2:
            parent[key] = _value(rng)
        elif op == 3 and isinstance(parent, dict):
            del parent[key]
        elif op == 3 and isinstance(parent, list):
            parent.pop(key)
        elif op == 4 and isinstance(parent, dict):
            parent[rng.choice(keys)] = _value(rng)
        elif op == 5 and isinstance(parent, list):
            parent.extend(copy.deepcopy(parent[key]) for _ in range(rng.choice([1, 2, 70])))
        elif op == 6:
            deep: Any = parent[key]
            for _ in range(rng.choice([2, 70, 200])):
                deep = [deep]
            parent[key] = deep
        elif op == 7 and isinstance(_get(doc, path[:-1]), dict) and keys[0] == "apiVersion":
            node = doc.get("nodes") if isinstance(doc, dict) else None
            if isinstance(node, list) and node and isinstance(node[0], dict):
                devs = node[0].setdefault("devices", [])
                if isinstance(devs, list):
                    devs.append(copy.deepcopy(rng.choice(HOSTILE_DEVICES)))
    return doc


def render_text(doc: Any, rng: random.Random) -> str:
    try:
        text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=rng.random() < 0.5,
                              width=rng.choice([80, 10**6]))
    except (yaml.YAMLError, ValueError):
        text = repr(doc)
    except RecursionError:  # nested past what the dumper can write: nest the text instead
        n = rng.choice([500, 5000, 100_000])
        text = "steps: " + "[" * n + "]" * n
    r = rng.random()
    if r < 0.05 and text:
        cut = rng.randrange(len(text))
        text = text[:cut]  # truncated
    elif r < 0.10 and text:
        at = rng.randrange(len(text))
        text = text[:at] + rng.choice(["\t", "{", "[", "&a ", "*a", "<<: *a\n", "!!python/int 1",
                                       ": ", "- ", "\"", "'", "%YAML 1.1\n---\n"]) + text[at:]
    return text


PROFILE_KEYS = [
    "apiVersion", "kind", "metadata", "name", "nodes", "count", "cpu", "sockets",
    "coresPerSocket", "threadsPerCore", "vendor", "numa", "id", "cpus", "memory", "devices",
    "type", "model", "numaNode", "pciAddresses", "sriov", "totalVFs", "numVFs", "ports",
    "labels", "devNodes", "driver", "partitions", "hugepages", "distances", "pci",
    "hostBridges", "bus", "domain", "switches", "switch", "health", "healthReason", "colour",
]
SCENARIO_KEYS = [
    "version", "seed", "steps", "at", "do", "device", "health", "reason", "repeat", "every",
    "num_vfs", "changes", "over", "devices", "ops", "expect", "plugged", "max_vfs", "nope",
]


def _alarm(_signum: int, _frame: Any) -> None:
    raise TimeoutError(f"example took more than {PER_EXAMPLE_SECONDS} s")


def run_profiles(seed: int, count: int) -> None:
    from sandbox.errors import ProfileError
    from sandbox.fakehw.build import build_tree
    from sandbox.profile import load_profile_text

    seeds = seed_profiles()
    for i in range(count):
        rng = random.Random(f"profile:{seed}:{i}")
        text = render_text(mutate(rng.choice(seeds), rng, PROFILE_KEYS), rng)
        name = f"fuzz-{seed}-{i}.yaml"
        signal.alarm(PER_EXAMPLE_SECONDS)
        try:
            cluster = load_profile_text(text, name).cluster
            for node in cluster.nodes[:2]:
                build_tree(node)
        except ProfileError as exc:
            bad = [str(p) for p in exc.problems
                   if p.file != name or p.line < 1 or p.column < 1 or not p.message]
            if bad or not exc.problems:
                _fail("profile", seed, i, f"unlocated problem(s): {bad}", text)
        except BaseException as exc:  # noqa: BLE001 - anything else is what we hunt
            _fail("profile", seed, i, "".join(traceback.format_exception_only(exc)), text)
        finally:
            signal.alarm(0)
    print(json.dumps({"done": count}), flush=True)


def run_scenarios(seed: int, count: int) -> None:
    from sandbox.errors import ScenarioError
    from sandbox.fakehw.scenario import expand, parse_scenario_text

    seeds = seed_scenarios()
    for i in range(count):
        rng = random.Random(f"scenario:{seed}:{i}")
        text = render_text(mutate(rng.choice(seeds), rng, SCENARIO_KEYS), rng)
        if rng.random() < 0.03:
            text = text.encode("utf-8").decode("latin-1") + "\udcff"  # not clean text
        signal.alarm(PER_EXAMPLE_SECONDS)
        try:
            expand(parse_scenario_text(text, source=f"fuzz-{seed}-{i}"), ["gpu0", "nic0"])
        except ScenarioError as exc:
            if not exc.problems or not all(exc.problems):
                _fail("scenario", seed, i, "empty problem list", text)
        except BaseException as exc:  # noqa: BLE001
            _fail("scenario", seed, i, "".join(traceback.format_exception_only(exc)), text)
        finally:
            signal.alarm(0)
    print(json.dumps({"done": count}), flush=True)


def _fail(kind: str, seed: int, i: int, error: str, text: str) -> None:
    print(json.dumps({"kind": kind, "seed": seed, "index": i, "error": error.strip(),
                      "input": text[:2000]}), flush=True)


def main() -> None:
    kind, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if len(sys.argv) > 4:  # the memory limit a user's process might run under
        limit = int(sys.argv[4])
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _alarm)
    (run_profiles if kind == "profile" else run_scenarios)(seed, count)


if __name__ == "__main__":
    main()
