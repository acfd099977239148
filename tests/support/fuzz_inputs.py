"""Structure-aware mutators for profiles and scenarios, and the batch runner the fuzz tests
start as a subprocess.

    python -m tests.support.fuzz_inputs profile|mixed|scenario SEED COUNT [ADDRESS-SPACE-BYTES]

Each example is drawn from ``random.Random(f"{kind}:{SEED}:{i}")`` (so a failure names
its seed and index and can be replayed; ``mixed`` replays the mixed-vendor device edits
tests/profile/test_profile_fuzz.py runs) and put through the whole path (profile, mixed: load ->
resolve -> build every node; scenario: parse -> expand) in a child forked for it alone
(``run_limited``: a warm interpreter, so a fork costs about a millisecond), which limits
its own address space (RLIMIT_AS), CPU time (RLIMIT_CPU) and wall time (an alarm), while
the batch waits for it with a deadline and kills it past that. Judged: only the input
error type may escape, and every problem must carry a line and a column (1:1 only for
a file that could not be parsed at all, or for the document's first value). A child that
crashed, hung or raised anything else is a failure. One JSON line per failure on stdout,
then ``{"done": COUNT}``.
"""

from __future__ import annotations

import copy
import faulthandler
import functools
import gc
import json
import os
import random
import re
import resource
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import yaml

from tests.support.fuzz_devices import MIXED_SEEDS, NEAR_LIMITS, mutate_devices
from tests.support.paths import REPO as ROOT

if TYPE_CHECKING:
    from sandbox.errors import ProfileError

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


def edit_values(doc: Any, rng: random.Random) -> Any:
    """1-3 small edits: a value replaced by one near a limit, a key dropped or added."""
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(_paths(doc))
        if not path:
            continue
        parent = _get(doc, path[:-1])
        op = rng.randrange(4)
        if op <= 1:
            parent[path[-1]] = copy.deepcopy(rng.choice(NEAR_LIMITS))
        elif op == 2 and isinstance(parent, dict):
            del parent[path[-1]]
        elif op == 2 and isinstance(parent, list):
            parent.pop(path[-1])
        elif isinstance(parent, dict):
            parent[rng.choice(PROFILE_KEYS + ["afuIds", "drm", "linkLayer", "rdma",
                                              "namespaces", "lbaSize", "vendorId"])] = \
                copy.deepcopy(rng.choice(NEAR_LIMITS))
    return doc


def mixed_case(seed: int, i: int, seeds: list[Any]) -> str:
    """A seed (a shipped profile one time in ten, else a small mixed-vendor one: that
    loads and builds in a fraction of the time) under device edits and, half the time,
    small value edits too; YAML by libyaml's emitter where it has one, in block or flow
    style."""
    rng = random.Random(f"mixed:{seed}:{i}")
    doc = mutate_devices(rng.choice(seeds) if rng.random() < 0.1 else rng.choice(MIXED_SEEDS),
                         rng)
    if rng.random() < 0.5:
        doc = edit_values(doc, rng)
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    try:
        return yaml.dump(doc, Dumper=dumper, sort_keys=False, allow_unicode=True,
                         default_flow_style=rng.choice([False, None]))
    except (yaml.YAMLError, ValueError, RecursionError):
        return render_text(doc, rng)


PER_EXAMPLE_CPU_SECONDS = 20
DEADLINE_GRACE = 15  # seconds past the child's own alarm before the batch kills it
DEFAULT_MEMORY = 2 << 30


def _alarm(_signum: int, _frame: Any) -> None:
    raise TimeoutError(f"example took more than {PER_EXAMPLE_SECONDS} s")


def run_limited(fn: Callable[[], str | None], *, memory: int = DEFAULT_MEMORY,
                cpu_seconds: int = PER_EXAMPLE_CPU_SECONDS,
                wall_seconds: int = PER_EXAMPLE_SECONDS,
                grace: float = DEADLINE_GRACE) -> str | None:
    """``fn()`` in a forked child under an address-space, CPU-time and wall-time limit.

    ``fn`` returns None (fine) or what went wrong; any exception it raises is what went
    wrong too. Returns None, or a description of the failure: what ``fn`` said, the
    child's traceback, or how it died (a signal, its CPU limit, the deadline)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            os.close(r)
            report = open(w, "wb", buffering=0, closefd=False)  # noqa: SIM115
            faulthandler.enable(report)  # a fatal signal's traceback goes to the parent
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 5))
            signal.signal(signal.SIGALRM, _alarm)
            signal.alarm(wall_seconds)
            try:
                verdict = fn()
            except BaseException as exc:  # noqa: BLE001 - anything is what we hunt
                verdict = "".join(traceback.format_exception(exc))[-4000:]
            signal.alarm(0)
            if verdict:
                data = verdict.encode("utf-8", "backslashreplace")
                while data:
                    data = data[os.write(w, data):]
        except BaseException:  # noqa: BLE001 - even the report failed: say so by the code
            code = 3
        os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + wall_seconds + grace
    hung = False
    try:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([r], [], [], max(left, 0))
            if not ready:
                hung = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    said = b"".join(chunks).decode("utf-8", "replace")
    if hung:
        return f"hung: no exit within {wall_seconds + grace:g} s (killed)\n{said}"
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status))
        why = f" (more than {cpu_seconds} s of CPU)" if sig is signal.SIGXCPU else ""
        return f"crashed: killed by {sig.name}{why}\n{said}"
    if os.WEXITSTATUS(status) != 0:
        return f"crashed: exited {os.WEXITSTATUS(status)}\n{said}"
    return said or None


def _top_level(path: str, text: str) -> bool:
    """Whether ``path`` names the document itself or one of its top-level keys, and the
    document starts at line 1, column 1 (so 1:1 is where it is)."""
    from sandbox.yamlnodes import compose_fast

    # composed as the loaders compose it: libyaml first (it takes tabs inside plain
    # scalars, as YAML allows and PyYAML's own scanner does not), else PyYAML's parser
    fast = compose_fast(text)
    if fast is not None:
        root = fast[1]
    else:
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except (yaml.YAMLError, RecursionError, ValueError):
            return False
    if root is None or (root.start_mark.line, root.start_mark.column) != (0, 0):
        return False
    keys = {str(k.value) for k, _ in root.value} if isinstance(root, yaml.MappingNode) else set()
    return path in keys or ("." not in path and "[" not in path)


PROFILE_WHOLE_FILE = ("invalid YAML", "empty file")
SCENARIO_WHOLE_FILE = ("not YAML", "empty file")


def check_profile(text: str, name: str) -> str | None:
    """Load, resolve and build every node of ``text``: None if only located ProfileErrors
    came out, else what is wrong (a profile that loads must build: a TreeError raises)."""
    from sandbox.errors import ProfileError
    from sandbox.fakehw.builder import build_tree
    from sandbox.profile import load_profile_text

    try:
        cluster = load_profile_text(text, name).cluster
        for node in cluster.nodes:
            build_tree(node)
    except ProfileError as exc:
        return unlocated(exc, text, name)
    return None


def unlocated(exc: ProfileError, text: str, name: str) -> str | None:
    """What is wrong with the problems of a ProfileError for ``text`` (file ``name``):
    None if every one is located (``name:line:col``, 1:1 only where that is the value)."""
    if not exc.problems:
        return "ProfileError without problems"
    bad = [str(p) for p in exc.problems
           if p.file != name or p.line < 1 or p.column < 1 or not p.message]
    whole = len(exc.problems) == 1 and not exc.problems[0].path and \
        exc.problems[0].message.startswith(PROFILE_WHOLE_FILE)
    at_start = [p for p in exc.problems if (p.line, p.column) == (1, 1)]
    if at_start and not whole and not all(_top_level(p.path, text) for p in at_start):
        bad += [str(p) for p in at_start]
    return f"unlocated problem(s): {bad}" if bad else None


_LOCATED = re.compile(r"(?P<line>[0-9]+):(?P<col>[0-9]+): (?P<rest>.*)", re.DOTALL)


def check_scenario(text: str, source: str) -> str | None:
    """Parse and expand ``text``: None if only located ScenarioErrors came out."""
    from sandbox.errors import ScenarioError
    from sandbox.fakehw.control.scenario import expand, parse_scenario_text

    try:
        expand(parse_scenario_text(text, source=source), ["gpu0", "nic0"])
    except ScenarioError as exc:
        if not exc.problems:
            return "ScenarioError without problems"
        bad = []
        for problem in exc.problems:
            m = _LOCATED.fullmatch(problem[len(source) + 1:]) \
                if problem.startswith(source + ":") else None
            if m is None or int(m["line"]) < 1 or int(m["col"]) < 1 or not m["rest"]:
                bad.append(problem)
            elif (m["line"], m["col"]) == ("1", "1"):
                whole = len(exc.problems) == 1 and m["rest"].startswith(SCENARIO_WHOLE_FILE)
                path = "" if m["rest"].startswith("expected a mapping") else \
                    m["rest"].split(": ", 1)[0]
                if not whole and not _top_level(path, text):
                    bad.append(problem)
        return f"unlocated problem(s): {bad}" if bad else None
    return None


def profile_case(seed: int, i: int, seeds: list[Any]) -> str:
    rng = random.Random(f"profile:{seed}:{i}")
    return render_text(mutate(rng.choice(seeds), rng, PROFILE_KEYS), rng)


def scenario_case(seed: int, i: int, seeds: list[Any]) -> str:
    rng = random.Random(f"scenario:{seed}:{i}")
    text = render_text(mutate(rng.choice(seeds), rng, SCENARIO_KEYS), rng)
    if rng.random() < 0.03:
        text = text.encode("utf-8").decode("latin-1") + "\udcff"  # not clean text
    return text


def run_batch(kind: str, seed: int, count: int, memory: int) -> None:
    """Every example of a batch, each in its own limited child (see the module doc)."""
    import sandbox.fakehw.builder  # noqa: F401 - warm: every child starts with these loaded
    import sandbox.fakehw.control.scenario  # noqa: F401
    import sandbox.profile  # noqa: F401

    seeds = seed_scenarios() if kind == "scenario" else seed_profiles()
    make = {"profile": profile_case, "mixed": mixed_case, "scenario": scenario_case}[kind]
    check = check_scenario if kind == "scenario" else check_profile
    for k, doc in enumerate(seeds):  # warm the parent's lazy caches: a child's start is
        warm = check(yaml.safe_dump(doc, sort_keys=False), f"seed-{k}")  # cheaper then
        if warm:
            _fail(kind, seed, -1 - k, f"an unmutated seed fails: {warm}", str(doc))
    gc.collect()
    gc.freeze()  # no collection in a child touches (and so copies) the parent's objects
    for i in range(count):
        text = make(seed, i, seeds)
        name = f"fuzz-{seed}-{i}" + ("" if kind == "scenario" else ".yaml")
        verdict = run_limited(functools.partial(check, text, name), memory=memory)
        if verdict:
            _fail(kind, seed, i, verdict, text)
    print(json.dumps({"done": count}), flush=True)


def _fail(kind: str, seed: int, i: int, error: str, text: str) -> None:
    print(json.dumps({"kind": kind, "seed": seed, "index": i, "error": error.strip(),
                      "input": text[:2000]}), flush=True)


def main() -> None:
    kind, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    memory = int(sys.argv[4]) if len(sys.argv) > 4 else DEFAULT_MEMORY
    run_batch(kind, seed, count, memory)


if __name__ == "__main__":
    main()
