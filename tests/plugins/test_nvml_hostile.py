"""Our NVML (sandbox/nvml) against hostile files where it expects regular ones: a
FIFO (or a symbolic link) as the state file, as a GPU's ``information`` file, or as
``HWSANDBOX_NVML_LOG``. Each must give an NVML answer (an error code, or success without
that file, docs/nvml.md "Hostile files") instead of blocking in ``open``/``read`` while
holding the library's lock, which would block every other thread calling in too.

The real built library runs in a subprocess (tests/support/nvml_ctypes.py's layouts are not needed:
only return codes and counts are looked at) with two threads calling in at once, under a
timeout: a hang is a failed test, not a hung test run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest

from tests.plugins.test_nvml import STATE, rendered
from tests.support import nvml_ctypes as N
from tests.support.nvidia import nvml_library

HANG_TIMEOUT = 60  # seconds; the calls take milliseconds, so only a hang reaches this

# Runs "pre" steps, then each list in "threads" in its own thread (all at once), then
# "post"; prints every step's result. A step is a name (below) or "set:X"/"wait:X"
# (threading.Event X), so one thread can act after another's step.
_PROBE = r"""
import ctypes, json, os, sys, threading
lib = ctypes.CDLL(sys.argv[1])
plan = json.loads(sys.argv[2])
events = {}

def count():
    n = ctypes.c_uint()
    return [lib.nvmlDeviceGetCount_v2(ctypes.byref(n)), n.value]

def memory():
    h = ctypes.c_void_p()
    r = lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))
    if r:
        return [r, 0]
    m = (ctypes.c_ulonglong * 3)()
    return [lib.nvmlDeviceGetMemoryInfo(h, m), m[0]]

def wait_for_event():
    # registering starts the poller thread, which re-reads the state file with the lock
    s = ctypes.c_void_p()
    r = lib.nvmlEventSetCreate(ctypes.byref(s))
    if r:
        return [r]
    h = ctypes.c_void_p()
    codes = [lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))]
    codes.append(lib.nvmlDeviceRegisterEvents(h, ctypes.c_ulonglong(8), s))
    ev = (ctypes.c_ulonglong * 4)()
    codes.append(lib.nvmlEventSetWait_v2(s, ev, 200))
    codes.append(lib.nvmlEventSetFree(s))
    return codes

def numa():
    h = ctypes.c_void_p()
    r = lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))
    if r:
        return [r, 0]
    n = ctypes.c_uint()
    return [lib.nvmlDeviceGetNumaNodeId(h, ctypes.byref(n)), n.value]

def fifo_as_state():
    path = os.environ["PROBE_STATE"]
    os.unlink(path)
    os.mkfifo(path)
    return "fifo"

STEPS = {
    "init": lambda: lib.nvmlInit_v2(),
    "shutdown": lambda: lib.nvmlShutdown(),
    "count": count,
    "memory": memory,
    "numa": numa,
    "stub": lambda: lib.nvmlDeviceGetPowerUsage(),  # not implemented: logged
    "events": wait_for_event,
    "fifo-as-state": fifo_as_state,
}

def run(steps):
    done = []
    for step in steps:
        kind, _, name = step.partition(":")
        if kind == "set":
            events.setdefault(name, threading.Event()).set()
        elif kind == "wait":
            events.setdefault(name, threading.Event()).wait()
        else:
            done.append(STEPS[step]())
    return done

for steps in plan["threads"]:
    for step in steps:
        if ":" in step:
            events.setdefault(step.partition(":")[2], threading.Event())
out = {"pre": run(plan.get("pre", []))}
results = [None] * len(plan["threads"])
def worker(i, steps):
    results[i] = run(steps)
threads = [threading.Thread(target=worker, args=(i, s)) for i, s in enumerate(plan["threads"])]
for t in threads:
    t.start()
for t in threads:
    t.join()
out["threads"] = results
out["post"] = run(plan.get("post", []))
print(json.dumps(out))
"""


def probe(env: dict[str, str], plan: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Run ``plan`` against the real library; (its results, its stderr). A hang FAILS."""
    lib = nvml_library()
    full = {**os.environ, "HWSANDBOX_NVML_REFRESH_MS": "0", **env}
    if "HWSANDBOX_NVML_LOG" not in env:
        full.pop("HWSANDBOX_NVML_LOG", None)
    try:
        result = subprocess.run([sys.executable, "-c", _PROBE, str(lib), json.dumps(plan)],
                                env=full, capture_output=True, text=True,
                                timeout=HANG_TIMEOUT, check=False)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        pytest.fail(f"the library blocked: no answer within {HANG_TIMEOUT} s "
                    f"(plan {plan}); stderr: {(err or '')[-2000:]}", pytrace=False)  # fmt: skip
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-3000:]}"
    return json.loads(result.stdout), result.stderr


@contextmanager
def idle_peer(fifo: Path, flags: int) -> Iterator[None]:
    """Hold ``fifo`` open (a writer that never writes, or a reader that never reads)."""
    fd = os.open(fifo, flags | os.O_NONBLOCK)
    try:
        yield
    finally:
        os.close(fd)


def fifo_at(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("peer", ["none", "idle-writer"])
def test_fifo_as_state_file_at_init_is_an_error_code(tmp_path: Path, peer: str) -> None:
    """No writer: a blocking open waits for one. An idle writer: the open returns and the
    read waits for data. Either way nvmlInit answers UNKNOWN (the state file exists but
    is no state file), in both threads, and nothing is initialized."""
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    fifo = fifo_at(root / STATE)
    plan = {"threads": [["init", "count"], ["init", "count", "shutdown"]]}
    with idle_peer(fifo, os.O_RDWR) if peer == "idle-writer" else nullcontext():
        out, _ = probe({"HWSANDBOX_NVML_ROOT": str(root)}, plan)
    assert out["threads"] == [[N.UNKNOWN, [N.UNINITIALIZED, 0]],
                              [N.UNKNOWN, [N.UNINITIALIZED, 0], N.UNINITIALIZED]]  # fmt: skip


def test_symlink_as_state_file_is_refused(tmp_path: Path) -> None:
    """The tree serves its files as files: a link at a file's place is not followed (it
    could lead anywhere, a device included), even to a good state file."""
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    state = root / STATE
    elsewhere = tmp_path / "state-elsewhere"
    elsewhere.write_bytes(state.read_bytes())
    state.unlink()
    state.symlink_to(elsewhere)
    out, _ = probe({"HWSANDBOX_NVML_ROOT": str(root)}, {"threads": [["init", "count"]]})
    assert out["threads"] == [[N.UNKNOWN, [N.UNINITIALIZED, 0]]]


def test_state_file_becoming_a_fifo_keeps_the_last_state(tmp_path: Path) -> None:
    """After nvmlInit, with every call re-reading the state file (refresh 0) and the event
    poller re-reading it too, a FIFO there is like a missing file: the last good state
    answers, in both threads, and shutdown (which joins the poller) returns."""
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    plan = {"pre": ["init", "fifo-as-state"],
            "threads": [["events", "memory", "set:polled", "count"],
                        ["wait:polled", "memory", "count", "stub"]],
            "post": ["shutdown"]}  # fmt: skip
    out, _ = probe({"HWSANDBOX_NVML_ROOT": str(root), "PROBE_STATE": str(root / STATE)}, plan)
    assert out["pre"] == [N.SUCCESS, "fifo"]
    mem = [N.SUCCESS, 80 * 1024**3]
    assert out["threads"] == [
        [[N.SUCCESS, N.SUCCESS, N.TIMEOUT, N.SUCCESS], mem, [N.SUCCESS, 8]],
        [mem, [N.SUCCESS, 8], N.NOT_SUPPORTED],
    ]
    assert out["post"] == [N.SUCCESS]


def test_fifo_as_information_file_skips_that_gpu(tmp_path: Path) -> None:
    """A GPU whose information file is a FIFO is skipped, as one without a readable
    information file is; the other seven answer, in both threads."""
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    gpus = sorted((root / "proc/driver/nvidia/gpus").iterdir())
    fifo_at(gpus[0] / "information")
    plan = {"threads": [["init", "count", "memory", "shutdown"],
                        ["init", "count", "memory", "shutdown"]]}  # fmt: skip
    out, _ = probe({"HWSANDBOX_NVML_ROOT": str(root)}, plan)
    step = [N.SUCCESS, [N.SUCCESS, 7], [N.SUCCESS, 80 * 1024**3], N.SUCCESS]
    assert out["threads"] == [step, step]


def test_fifo_as_pci_attribute_is_left_unread(tmp_path: Path) -> None:
    """The GPU's PCI attributes (sys/bus/pci/devices/<bdf>/, through sysfs' link) are read
    the same guarded way: a FIFO as numa_node or device is an attribute not there (NUMA
    node: NOT_SUPPORTED), the GPU itself stays."""
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    first = sorted((root / "proc/driver/nvidia/gpus").iterdir())[0].name
    pci = root / "sys/bus/pci/devices" / first
    assert pci.is_symlink()  # as in sysfs: the link above the file is followed
    fifo_at(pci / "numa_node")
    fifo_at(pci / "device")
    plan = {"threads": [["init", "count", "numa", "shutdown"],
                        ["init", "count", "numa", "shutdown"]]}  # fmt: skip
    out, _ = probe({"HWSANDBOX_NVML_ROOT": str(root)}, plan)
    step = [N.SUCCESS, [N.SUCCESS, 8], [N.NOT_SUPPORTED, 0], N.SUCCESS]
    assert out["threads"] == [step, step]


def test_fifo_as_gpus_directory_is_no_driver(tmp_path: Path) -> None:
    """proc/driver/nvidia/gpus is opened by opendir, which glibc opens O_DIRECTORY |
    O_NONBLOCK: a FIFO there is no directory, so no driver (a control: never blocked)."""
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    gpus = root / "proc/driver/nvidia/gpus"
    for info in gpus.glob("*/information"):
        info.unlink()
        info.parent.rmdir()
    gpus.rmdir()
    os.mkfifo(gpus)
    out, _ = probe({"HWSANDBOX_NVML_ROOT": str(root)}, {"threads": [["init"], ["init"]]})
    assert out["threads"] == [[N.DRIVER_NOT_LOADED]] * 2


@pytest.mark.parametrize("peer", ["none", "idle-reader"])
def test_fifo_as_log_is_not_logged_to(tmp_path: Path, peer: str) -> None:
    """No reader: a blocking open for writing waits for one. An idle reader: the open
    returns and writes block once the pipe is full. The log is only diagnostics, so
    nvmlInit succeeds without it and says so once on stderr; nothing reaches the FIFO."""
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    log = tmp_path / "nvml.log"
    os.mkfifo(log)
    plan = {"threads": [["init", "stub", "count", "shutdown"],
                        ["stub", "init", "count", "stub", "shutdown"]]}  # fmt: skip
    env = {"HWSANDBOX_NVML_ROOT": str(root), "HWSANDBOX_NVML_LOG": str(log)}
    if peer == "idle-reader":
        reader = os.open(log, os.O_RDONLY | os.O_NONBLOCK)
        try:
            out, stderr = probe(env, plan)
            try:
                logged = os.read(reader, 65536)
            except BlockingIOError:
                logged = b""
        finally:
            os.close(reader)
        assert logged == b""
    else:
        out, stderr = probe(env, plan)
    assert out["threads"] == [[N.SUCCESS, N.NOT_SUPPORTED, [N.SUCCESS, 8], N.SUCCESS],
                              [N.NOT_SUPPORTED, N.SUCCESS, [N.SUCCESS, 8], N.NOT_SUPPORTED,
                               N.SUCCESS]]  # fmt: skip
    refusals = [line for line in stderr.splitlines() if "HWSANDBOX_NVML_LOG" in line]
    assert len(refusals) == 1, stderr
    assert "not a regular file" in refusals[0], refusals
    assert str(log) in refusals[0], refusals


@pytest.mark.parametrize("log", ["missing-dir/nvml.log", "/dev/null"])
def test_unusable_log_path_is_said_once_and_dev_null_is_quiet(tmp_path: Path,
                                                             log: str) -> None:  # fmt: skip
    """A log path that cannot be opened is said on stderr once (it used to be silent);
    /dev/null, a character device, is taken as "no log" without a word."""
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    path = log if log.startswith("/") else str(tmp_path / log)
    plan = {"threads": [["init", "stub", "shutdown"], ["stub", "init", "shutdown"]]}
    out, stderr = probe({"HWSANDBOX_NVML_ROOT": str(root), "HWSANDBOX_NVML_LOG": path}, plan)
    assert out["threads"] == [[N.SUCCESS, N.NOT_SUPPORTED, N.SUCCESS],
                              [N.NOT_SUPPORTED, N.SUCCESS, N.SUCCESS]]  # fmt: skip
    refusals = [line for line in stderr.splitlines() if "HWSANDBOX_NVML_LOG" in line]
    if log == "/dev/null":
        assert refusals == [], stderr
    else:
        assert refusals == [f"hwsandbox-nvml: HWSANDBOX_NVML_LOG={path}: No such file or "
                            "directory; not logging (give a regular file, or - for "
                            "stderr)"], stderr  # fmt: skip


def test_regular_log_file_still_gets_every_line(tmp_path: Path) -> None:
    """The guarded open keeps a regular log working (a control for the FIFO cases)."""
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    log = tmp_path / "nvml.log"
    plan = {"threads": [["init", "stub", "shutdown"], ["init", "stub", "shutdown"]]}
    out, stderr = probe({"HWSANDBOX_NVML_ROOT": str(root), "HWSANDBOX_NVML_LOG": str(log)}, plan)
    assert out["threads"] == [[N.SUCCESS, N.NOT_SUPPORTED, N.SUCCESS]] * 2
    assert log.read_text().splitlines() == ["hwsandbox-nvml: unimplemented: "
                                            "nvmlDeviceGetPowerUsage"] * 2  # fmt: skip
    assert "HWSANDBOX_NVML_LOG" not in stderr
