"""``sandbox capture`` on 2,000 randomly built hostile roots (issue 21, acceptance).

Each root starts as a small valid machine built from a seeded ``random.Random`` (CPUs
with their topology, NUMA nodes, DMI, and PCI functions of every type capture knows: a
NIC with two ports and a VF, an NVMe drive, a GPU, an FPGA, a bridge, a generic one), and
then gets random hostile mutations: symlinks out of the root, absolute and ``../`` chains
past its top, to the canaries; FIFOs, sockets and device nodes where files belong; huge
sparse and binary files; odd numbers and lines; names with newlines, U+2028 and bytes
that are not UTF-8; link loops and dangling links; directories where files belong and
the reverse; missing files. A few roots have such a name themselves.

For every root, capture must return within ``PER_ROOT`` seconds (a per-root alarm, and
a timeout on each batch's process as a backstop) and either give a profile that
validates (``load_profile_text``) and is written by ``write_capture``, or raise one
``CaptureError`` whose message is one line starting with the root; anything else fails
the test with the seed. ``python -m tests.capture.test_capture_fuzz SEED [DIR]`` rebuilds that
root (in DIR, kept) and runs capture on it.

Nothing outside the root is read: next to the roots is ``outside/``, holding a file and
a directory of sysfs-like attributes with a unique string, and a FIFO; the links point
at them. The string must appear in no profile and no error, and an inotify watch on
``outside/`` and its directory, which reports every open of a file or directory and
every read, by any process, must report nothing (a blocking open of the FIFO, which
would not be reported, hangs instead: the alarm fails that root). Inside the root,
capture opens only directories and regular files: the FIFOs, sockets and device nodes a
root gets are watched the same way, and an open of one fails that root (opening one is
an act: a FIFO's waiting writer proceeds, a device's driver runs, a watchdog arms).

Real files and the real capture code; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.capture import CaptureError, capture, write_capture
from sandbox.profile import load_profile_text
from tests.support.hostile_roots import HostileRoot, Watch, build, make_outside, one_line
from tests.support.paths import REPO

pytestmark = pytest.mark.cpu_bound  # scripts/test runs these beside the e2e envs

ROOTS = int(os.environ.get("CAPTURE_FUZZ_ROOTS", "2000"))
FIRST = int(os.environ.get("CAPTURE_FUZZ_FIRST_SEED", "0"))  # to try other seeds
WORKERS = 2
PER_ROOT = 30.0  # seconds: a capture takes about 20 ms; only a hang comes near this
BATCH_TIMEOUT = 900.0  # seconds: the backstop when even the alarm cannot fire
MEMORY = 3 << 30  # bytes of address space per worker: a blow-up fails, not the machine


# --- one root, one batch --------------------------------------------------------------


_SPECIAL = (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK)


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def fire(_signum: int, _frame: object) -> None:
        raise _Hang

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def check(tree: HostileRoot, secret: str, out: Path) -> tuple[str, str | None]:
    """Capture one root: ("profile" | "refused", None), or the problem found."""
    root = tree.root
    watch = Watch()
    try:
        watch.add(tree.outside)  # (the test watches these too, for every root at once)
        watch.add(tree.outside / "dir")
        for path in tree.special:  # those a later mutation did not replace
            with contextlib.suppress(OSError):  # gone, or below a file now
                if stat.S_IFMT(os.lstat(path).st_mode) in _SPECIAL:
                    watch.add(path)
        outcome, problem = _capture(root, secret, out)
        opened = watch.events()
    finally:
        watch.close()
    outside = [e for e in opened if e.split(" ", 1)[1].startswith(str(tree.outside))]
    if outside:
        problem = "read outside the root: " + "; ".join(outside)
    elif problem is None and opened:
        problem = "opened a FIFO, socket or device node in the root: " + "; ".join(opened)
    return outcome, problem


def _capture(root: Path, secret: str, out: Path) -> tuple[str, str | None]:
    try:
        with _deadline(PER_ROOT):
            result = capture(root)
            load_profile_text(result.text, "<fuzz>")
    except _Hang:
        return "hang", f"capture did not return within {PER_ROOT} s"
    except CaptureError as exc:
        message = str(exc)
        expected = one_line(root) + ": "
        if secret in message:
            return "refused", f"the canary's text is in the error: {message!r}"
        if any(c in message for c in "\n\r\x85\u2028\u2029"):
            return "refused", f"the error is more than one line: {message!r}"
        if not message.startswith(expected):
            return "refused", f"the error does not start with {expected!r}: {message!r}"
        if "does not validate" in message:  # capture took in something it did not check
            return "refused", f"capture made a profile that does not validate: {message}"
        return "refused", None
    except Exception:
        return "crash", traceback.format_exc()
    if secret in result.text or secret in repr(result.profile):
        return "profile", "the canary's text is in the profile"
    try:
        write_capture(result, out, force=True)
    except Exception:
        return "profile", "write_capture failed: " + traceback.format_exc()
    if out.read_bytes() != result.text.encode():
        return "profile", "the written profile differs from the captured text"
    return "profile", None


def _batch(work: Path, outside: Path, secret: str, seeds: list[int]) -> None:
    """One worker: every seed's root built, captured and checked; one JSON line each."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    work.mkdir(parents=True, exist_ok=True)
    fifo = work / "fifo"
    os.mkfifo(fifo)
    watch = Watch()
    watch.add(fifo)
    watch.proven(fifo)  # the watch on a root's FIFOs works here
    watch.close()
    outcomes: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for seed in seeds:
        print(json.dumps({"start": seed}), flush=True)
        try:
            tree = build(work / "roots", outside, seed)
        except Exception:
            print(json.dumps({"seed": seed, "problem": "building the root failed: "
                              + traceback.format_exc()}), flush=True)
            continue
        outcome, problem = check(tree, secret, work / "out.yaml")
        outcomes[outcome] += 1
        kinds.update(tree.kinds)
        if problem is not None:
            print(json.dumps({"seed": seed, "kinds": tree.kinds, "problem": problem}), flush=True)
        shutil.rmtree(tree.root)
    print(json.dumps({"done": dict(outcomes), "kinds": dict(kinds)}), flush=True)


# --- the test -------------------------------------------------------------------------


@contextlib.contextmanager
def _scratch(tmp_path: Path) -> Iterator[Path]:
    """Where to build the roots: a tmpfs when there is one (the test makes and removes
    some 150,000 files; on a journalled disk that alone takes a minute of system time),
    else ``tmp_path``."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK | os.X_OK)):
        yield tmp_path
        return
    where = Path(tempfile.mkdtemp(prefix="capture-fuzz-", dir=shm))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_capture_of_random_hostile_roots(tmp_path: Path) -> None:
    with _scratch(tmp_path) as base:
        _fuzz(base)


def _fuzz(tmp_path: Path) -> None:
    secret = f"CANARY-{uuid.uuid4().hex}"
    outside = tmp_path / "outside"
    make_outside(outside, secret)
    watch = Watch()
    watch.add(outside)
    watch.add(outside / "dir")
    watch.proven(outside / "dir" / "vendor")
    watch.proven(outside / "fifo")
    started = time.monotonic()
    procs = []
    for k in range(WORKERS):
        seeds = list(range(FIRST + k, FIRST + ROOTS, WORKERS))
        code = ("import sys, json, pathlib; from tests.capture.test_capture_fuzz import _batch; "
                "a = sys.argv[1:]; _batch(pathlib.Path(a[0]), pathlib.Path(a[1]), a[2], "
                "json.loads(a[3]))")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / f"work{k}"), str(outside), secret,
             json.dumps(seeds)], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    problems: list[str] = []
    outcomes: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=BATCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        done = [x for x in lines if "done" in x]
        if not done:
            last = [x["start"] for x in lines if "start" in x]
            problems.append(f"seed {last[-1] if last else '?'}: the batch did not finish "
                            f"(exit {proc.returncode}): {stderr[-2000:]}")
            continue
        outcomes.update(done[0]["done"])
        kinds.update(done[0]["kinds"])
        problems += [f"seed {x['seed']} {x.get('kinds', '')}: {x['problem']}"
                     for x in lines if "problem" in x]
    elapsed = time.monotonic() - started
    read_outside = watch.events()
    watch.close()
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"{ROOTS} roots in {tmp_path} in {elapsed:.1f} s ({cpu.ru_utime + cpu.ru_stime:.1f} "
          f"s of CPU in {WORKERS} workers): {dict(outcomes)}; mutations {dict(kinds)}")
    assert not problems, (
        f"{len(problems)} problems (rerun one: python -m tests.capture.test_capture_fuzz SEED):\n"
        + "\n".join(problems[:20]))
    assert not read_outside, f"something read outside the roots: {read_outside[:20]}"
    assert sum(outcomes.values()) == ROOTS


def main(argv: list[str]) -> int:
    """``python -m tests.capture.test_capture_fuzz SEED [DIR]``: rebuild root SEED in DIR (a new
    temporary directory by default; kept), capture it and say what happened."""
    seed = int(argv[0])
    base = Path(argv[1]) if len(argv) > 1 else Path(tempfile.mkdtemp(prefix="capture-fuzz-"))
    secret = "CANARY-reproduce"
    outside = base / "outside"
    if not outside.exists():
        make_outside(outside, secret)
    tree = build(base / "roots", outside, seed)
    print(f"root {tree.root!r}, mutations {tree.kinds}")
    outcome, problem = check(tree, secret, base / "out.yaml")
    print(outcome, problem or "(as it should be)")
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
