"""Our NVML (sandbox/nvml, docs/nvml.md) driven directly through ctypes: it reports what
the node's tree says, follows faults made through the control socket, survives concurrent
callers and init/shutdown cycles, turns a missing or malformed state file into an NVML error
code, 10,000 random call sequences (in a subprocess) never crash it, and every entry point
it does not implement is exported and answers NOT_SUPPORTED.

The library is loaded into this process once; every test leaves its init count at zero, so
the next ``nvmlInit`` reads HWSANDBOX_NVML_ROOT afresh.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.nvml.build import SOURCES, entrypoints, implemented, stubs_source
from sandbox.profile import load_profile
from tests.plugins.test_nvidia_plugin import tree_gpus
from tests.support import nvml_ctypes as N
from tests.support.nvidia import nvml_library
from tests.support.thirdparty import PROFILES, REPO, live_node

pytestmark = [pytest.mark.root, pytest.mark.fuse]

STATE = "proc/driver/nvidia/hwsandbox/nvml"


def rendered(profile: str, out: Path) -> Path:
    cluster = load_profile(str(PROFILES / profile)).cluster
    render(build_tree(cluster.nodes[0]), out)
    return out


def init(nvml: N.Nvml, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HWSANDBOX_NVML_ROOT", str(root))
    nvml.check(nvml.nvmlInit_v2())


def test_reports_what_the_tree_says(nvml: N.Nvml, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    init(nvml, root, monkeypatch)
    gpus = tree_gpus(root)
    assert nvml.count() == 8
    seen = {}
    for i in range(8):
        h = nvml.handle(i)
        uuid = nvml.uuid(h)
        pci = nvml.pci(h)
        seen[uuid] = (pci.busId.decode(), nvml.uint("nvmlDeviceGetMinorNumber", h),
                      nvml.uint("nvmlDeviceGetNumaNodeId", h))  # fmt: skip
        assert nvml.text("nvmlDeviceGetName", h) == "NVIDIA H100 80GB HBM3"
        assert nvml.memory(h) == (N.SUCCESS, 80 * 1024**3)
        assert pci.pciDeviceId == 0x2330 << 16 | 0x10DE
        major, minor = ctypes.c_int(), ctypes.c_int()
        nvml.check(nvml.nvmlDeviceGetCudaComputeCapability(h, ctypes.byref(major),
                                                           ctypes.byref(minor)))  # fmt: skip
        assert (major.value, minor.value) == (9, 0)
        assert nvml.uint("nvmlDeviceGetArchitecture", h) == 9  # Hopper
        assert nvml.uint("nvmlDeviceGetIndex", h) == i
    assert seen == {u: (f"0000{g.bdf.upper()}", g.minor, g.numa_node) for u, g in gpus.items()}
    # NVML orders devices by PCI bus id
    assert [nvml.pci(nvml.handle(i)).busId for i in range(8)] == sorted(
        nvml.pci(nvml.handle(i)).busId for i in range(8))
    buf = ctypes.create_string_buffer(80)
    nvml.check(nvml.nvmlSystemGetDriverVersion(buf, 80))
    assert buf.value == b"550.54.15"
    assert nvml.nvmlSystemGetDriverVersion(buf, 4) == N.INSUFFICIENT_SIZE
    assert nvml.nvmlDeviceGetPowerUsage() == N.NOT_SUPPORTED  # a stub
    h = ctypes.c_void_p()
    uuid = next(iter(gpus))
    nvml.check(nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(h)))
    assert nvml.uuid(h) == uuid
    nvml.check(nvml.nvmlDeviceGetHandleByPciBusId_v2(gpus[uuid].bdf.encode(), ctypes.byref(h)))
    assert nvml.uuid(h) == uuid


def test_mig_devices_follow_the_layout(nvml: N.Nvml, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    root = rendered("mig-partitions.yaml", tmp_path / "root")
    init(nvml, root, monkeypatch)
    state = (root / STATE).read_text()
    h = nvml.handle(0)
    cur, pend = ctypes.c_uint(), ctypes.c_uint()
    nvml.check(nvml.nvmlDeviceGetMigMode(h, ctypes.byref(cur), ctypes.byref(pend)))
    assert (cur.value, pend.value) == (1, 1)
    names = []
    for k in range(8):
        m = ctypes.c_void_p()
        ret = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k, ctypes.byref(m))
        if ret == N.NOT_FOUND:
            break
        nvml.check(ret)
        assert nvml.uint("nvmlDeviceIsMigDeviceHandle", m) == 1
        names.append(nvml.text("nvmlDeviceGetName", m))
        assert nvml.uuid(m) in state
        parent = ctypes.c_void_p()
        nvml.check(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m, ctypes.byref(parent)))
        assert parent.value == h.value
    assert names == [f"NVIDIA A100-SXM4-80GB MIG {p}"
                     for p in ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")]  # fmt: skip


# NVIDIA's MIG user guide's A100/H100 placements (start, size in memory slices) by GPU
# instance profile id: 1g.10gb, 2g.20gb, 3g.40gb, 7g.80gb (the profiles mig-partitions'
# A100s list; each profile's count of placements is its instanceCount)
A100_PLACEMENTS = {0: [(s, 1) for s in range(7)], 1: [(0, 2), (2, 2), (4, 2)],
                   2: [(0, 4), (4, 4)], 4: [(0, 8)]}


def test_possible_placements_of_each_gpu_instance_profile(
        nvml: N.Nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvmlDeviceGetGpuInstancePossiblePlacements(_v2), which NVIDIA's DRA driver asks
    before it lists a GPU's MIG profiles: NULL asks for the count, a short buffer is
    INSUFFICIENT_SIZE, an unknown profile id NOT_SUPPORTED, a GPU without MIG too."""
    root = rendered("mig-partitions.yaml", tmp_path / "root")
    init(nvml, root, monkeypatch)
    h = nvml.handle(0)
    for fn in ("nvmlDeviceGetGpuInstancePossiblePlacements_v2",
               "nvmlDeviceGetGpuInstancePossiblePlacements"):
        call = getattr(nvml, fn)
        for profile_id, want in A100_PLACEMENTS.items():
            n = ctypes.c_uint()
            nvml.check(call(h, profile_id, None, ctypes.byref(n)))
            assert n.value == len(want), (fn, profile_id)
            out = (ctypes.c_uint * (2 * n.value))()
            nvml.check(call(h, profile_id, out, ctypes.byref(n)))
            assert list(zip(out[0::2], out[1::2], strict=True)) == want, (fn, profile_id)
        short = ctypes.c_uint(1)
        assert call(h, 0, (ctypes.c_uint * 2)(), ctypes.byref(short)) == N.INSUFFICIENT_SIZE
        assert short.value == 7
        assert call(h, 0, None, None) == N.INVALID_ARGUMENT
        assert call(h, 3, None, ctypes.byref(short)) == N.NOT_SUPPORTED  # 4g.40gb: not listed


def test_faults_reach_nvml_as_xid_events_and_lost_gpus(
    nvml: N.Nvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    with live_node("8gpu-2numa.yaml", "gpu-worker") as live:
        init(nvml, live.root, monkeypatch)
        with live.client() as client:
            devices = client.devices()
        index = {nvml.pci(nvml.handle(i)).busId.decode()[4:].lower(): i for i in range(8)}
        h3 = nvml.handle(index[devices["gpu3"]["pci_address"]])
        h6 = nvml.handle(index[devices["gpu6"]["pci_address"]])
        evset = ctypes.c_void_p()
        nvml.check(nvml.nvmlEventSetCreate(ctypes.byref(evset)))
        for i in range(8):
            nvml.check(nvml.nvmlDeviceRegisterEvents(nvml.handle(i), ctypes.c_ulonglong(
                N.EVENT_XID), evset))
        ev = N.EventData()
        assert nvml.nvmlEventSetWait_v2(evset, ctypes.byref(ev), 50) == N.TIMEOUT

        def wait_event() -> N.EventData:
            ev = N.EventData()
            nvml.check(nvml.nvmlEventSetWait_v2(evset, ctypes.byref(ev), 10_000))
            return ev

        with live.client() as client:
            client.health("gpu3", "unhealthy", "aer-fatal")
        ev = wait_event()
        assert (ev.device, ev.eventType, ev.eventData) == (h3.value, N.EVENT_XID, 48)
        assert (ev.gpuInstanceId, ev.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)
        assert nvml.memory(h3)[0] == N.SUCCESS  # an Xid, not a lost GPU

        with live.client() as client:
            client.unplug("gpu6")
        ev = wait_event()
        assert (ev.device, ev.eventData) == (h6.value, 79)
        assert nvml.memory(h6)[0] == N.GPU_IS_LOST
        assert nvml.uuid(h6)  # identity stays readable, so the event can be attributed
        h = ctypes.c_void_p()
        assert nvml.nvmlDeviceGetHandleByIndex_v2(index[devices["gpu6"]["pci_address"]],
                                                  ctypes.byref(h)) == N.GPU_IS_LOST

        with live.client() as client:  # recovery: no event, queries work again
            client.health("gpu3", "healthy")
            client.plug("gpu6")
        assert nvml.memory(h6) == (N.SUCCESS, 80 * 1024**3)
        assert nvml.nvmlEventSetWait_v2(evset, ctypes.byref(ev), 300) == N.TIMEOUT
        with live.client() as client:  # events queue until waited for, like the driver's
            client.health("gpu3", "unhealthy", "link-down")
            time.sleep(0.3)  # pacing, not a measurement: longer than the 10 ms poll
            client.health("gpu3", "healthy")
            time.sleep(0.3)
            client.health("gpu3", "unhealthy", "aer-fatal")
        assert [wait_event().eventData for _ in range(2)] == [79, 48]

        # a GPU's ECC reasons, each its own Xid (tree.SIGNS); sysfs readers see them as
        # aer-fatal (an uncorrectable internal error in aer_dev_fatal)
        aer = live.root / "sys/bus/pci/devices" / devices["gpu3"]["pci_address"] / "aer_dev_fatal"
        for reason, xid in (("row-remap-pending", 63), ("row-remap-failure", 64),
                            ("ecc-contained", 94), ("ecc-uncontained", 95)):  # fmt: skip
            with live.client() as client:
                client.health("gpu3", "healthy")
                assert "TOTAL_ERR_FATAL 0" in aer.read_text()
                client.health("gpu3", "unhealthy", reason)
            ev = wait_event()
            assert (ev.device, ev.eventType, ev.eventData) == (h3.value, N.EVENT_XID, xid)
            assert nvml.memory(h3)[0] == N.SUCCESS  # an Xid, not a lost GPU
            assert aer.read_text().splitlines()[-1] == "TOTAL_ERR_FATAL 1"
            assert "UncorrIntErr 1" in aer.read_text().splitlines()
        assert nvml.nvmlEventSetWait_v2(evset, ctypes.byref(ev), 300) == N.TIMEOUT
        nvml.check(nvml.nvmlEventSetFree(evset))


@pytest.mark.parametrize("damage", ["missing", "garbage", "truncated", "bad-number",
                                    "no-gpus-dir"])  # fmt: skip
def test_missing_or_malformed_state_is_an_error_code(
    nvml: N.Nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    state = root / STATE
    text = state.read_text()
    expected = N.UNKNOWN
    if damage == "missing":
        state.unlink()
        expected = N.DRIVER_NOT_LOADED
    elif damage == "garbage":
        state.write_bytes(bytes(range(256)) * 4)
    elif damage == "truncated":
        state.write_text(text[: text.index("cuda")])
    elif damage == "bad-number":
        state.write_text(re.sub(r"memory=\d+", "memory=-5", text, count=1))
    else:
        for info in (root / "proc/driver/nvidia/gpus").glob("*/information"):
            info.unlink()
            info.parent.rmdir()
        (root / "proc/driver/nvidia/gpus").rmdir()
        expected = N.DRIVER_NOT_LOADED
    monkeypatch.setenv("HWSANDBOX_NVML_ROOT", str(root))
    assert nvml.nvmlInit_v2() == expected
    n = ctypes.c_uint()
    assert nvml.nvmlDeviceGetCount_v2(ctypes.byref(n)) == N.UNINITIALIZED
    assert nvml.nvmlShutdown() == N.UNINITIALIZED
    if damage == "no-gpus-dir":
        return
    # after init, a state file gone bad keeps the last good state
    state.write_text(text)
    init(nvml, root, monkeypatch)
    state.write_text("format 1\ngpu nonsense\n")
    assert nvml.memory(nvml.handle(0)) == (N.SUCCESS, 80 * 1024**3)


def test_concurrent_callers_and_init_shutdown_cycles(
    nvml: N.Nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = rendered("mig-partitions.yaml", tmp_path / "root")
    init(nvml, root, monkeypatch)  # held by the test: the count never drops to zero
    problems: list[str] = []
    allowed = {N.SUCCESS, N.UNINITIALIZED, N.NOT_FOUND, N.INVALID_ARGUMENT}

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                cycles = rng.random() < 0.2
                if cycles:
                    nvml.check(nvml.nvmlInit_v2())
                h = ctypes.c_void_p()
                ret = nvml.nvmlDeviceGetHandleByIndex_v2(rng.randrange(4), ctypes.byref(h))
                if ret == N.SUCCESS:
                    if nvml.uuid(h) not in (root / STATE).read_text() + tree_text:
                        problems.append(f"unknown uuid from {h}")
                    m = ctypes.c_void_p()
                    ret = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, rng.randrange(5),
                                                                   ctypes.byref(m))  # fmt: skip
                    if ret == N.SUCCESS:
                        ret = nvml.memory(m)[0]
                if ret not in allowed:
                    problems.append(f"code {ret}")
                if cycles:
                    nvml.check(nvml.nvmlShutdown())
        except Exception as e:  # a worker's failure is the test's
            problems.append(repr(e))

    tree_text = "".join(tree_gpus(root))
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == []
    assert nvml.count() == 4
    nvml.check(nvml.nvmlShutdown())
    for _ in range(200):  # full cycles: every init re-reads the tree
        nvml.check(nvml.nvmlInit_v2())
        assert nvml.count() == 4
        nvml.check(nvml.nvmlShutdown())
    h = ctypes.c_void_p()
    assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)) == N.UNINITIALIZED
    assert nvml.nvmlShutdown() == N.UNINITIALIZED


def test_ten_thousand_random_call_sequences_never_crash(tmp_path: Path) -> None:
    lib = nvml_library()
    total: dict[str, int] = {}
    for profile, seed in (("mig-partitions.yaml", 1), ("8gpu-2numa.yaml", 2)):
        root = rendered(profile, tmp_path / profile)
        env = {**os.environ, "HWSANDBOX_NVML_ROOT": str(root), "HWSANDBOX_NVML_REFRESH_MS": "0"}
        env.pop("HWSANDBOX_NVML_LOG", None)
        result = subprocess.run(
            [sys.executable, "-m", "tests.support.nvml_ctypes", "fuzz", str(lib), str(root), "5000",
             str(seed)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-3000:]}"
        for item in result.stdout.split():
            code, n = item.split(":")
            total[code] = total.get(code, 0) + int(n)
    # the sequences reached the library's real answers, not only its refusals
    assert total.get("0", 0) > 1000, total
    assert {"0", "1", "2", "3"} <= set(total), total


_CALL_EACH = """
import ctypes, json, os, sys
lib = ctypes.CDLL(sys.argv[1])
names = json.loads(sys.argv[2])
before = {n: getattr(lib, n)() for n in names}  # no nvmlInit yet
assert lib.nvmlInit_v2() == 0
after = {n: getattr(lib, n)() for n in names}
assert lib.nvmlShutdown() == 0
print(json.dumps({"before": before, "after": after}))
"""


def test_every_entry_point_is_exported_and_stubs_answer_not_supported(tmp_path: Path) -> None:
    """entrypoints.txt is what the library exports (nm -D); each name our C sources do not
    implement is a stub that takes no arguments, logs the call and returns NOT_SUPPORTED.
    Every stub is called, with no arguments, before and after nvmlInit, in a subprocess
    (a crash fails this test, not the test run)."""
    lib = nvml_library()
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True,
                        text=True, timeout=60, check=False)  # fmt: skip
    assert nm.returncode == 0, f"nm (binutils) failed: {nm.stderr}; apt-get install binutils"
    exported = {parts[2] for parts in (line.split() for line in nm.stdout.splitlines())
                if len(parts) == 3 and parts[1] == "T"}  # fmt: skip
    names, done = entrypoints(), implemented()
    assert len(names) == len(set(names)), "entrypoints.txt lists a name twice"
    assert set(names) | done == exported  # nothing missing, nothing extra (no helpers leak)
    stubs = sorted(set(names) - done)
    assert len(stubs) > 300, len(stubs)
    # each stub is defined with no parameters and passes none on, so calling it with none
    # (or, from C, with any) reads nothing from the caller
    stub = re.compile(r'__attribute__\(\(visibility\("default"\)\)\) int (\w+)\(void\) '
                      r'\{ return hwsandbox_nvml_unimplemented\("(\w+)"\); \}')
    defined = [stub.fullmatch(line) for line in stubs_source().splitlines()[2:]]
    assert all(m is not None and m[1] == m[2] for m in defined), stubs_source()[:3000]
    assert sorted(m[1] for m in defined if m is not None) == stubs

    root = rendered("8gpu-2numa.yaml", tmp_path / "root")
    log = tmp_path / "nvml.log"
    env = {**os.environ, "HWSANDBOX_NVML_ROOT": str(root), "HWSANDBOX_NVML_LOG": str(log)}
    result = subprocess.run([sys.executable, "-c", _CALL_EACH, str(lib), json.dumps(stubs)],
                            env=env, capture_output=True, text=True, timeout=120,
                            check=False)  # fmt: skip
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-3000:]}"
    answers = json.loads(result.stdout)
    for when in ("before", "after"):
        wrong = {n: c for n, c in answers[when].items() if c != N.NOT_SUPPORTED}
        assert wrong == {}, f"{when} nvmlInit: {wrong}"
        assert sorted(answers[when]) == stubs
    logged = re.findall(r"unimplemented: (\w+)", log.read_text())
    assert sorted(logged) == sorted(stubs * 2)


@pytest.mark.parametrize("sanitizer", ["address,undefined", "thread"])
def test_threads_under_sanitizers(tmp_path: Path, sanitizer: str) -> None:
    """tests/data/nvml_stress.c (8 threads of init/query/events/shutdown) linked with the
    library's source, both built with -fsanitize: any memory error, undefined behaviour or
    data race makes the run fail."""
    nvml_library()  # FAILS with the install hint when gcc is missing
    root = rendered("mig-partitions.yaml", tmp_path / "root")
    stubs = tmp_path / "stubs.c"
    stubs.write_text(stubs_source())
    exe = tmp_path / "stress"
    build = subprocess.run(
        ["gcc", "-O1", "-g", "-pthread", f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer",
         "-o", str(exe), str(REPO / "tests/data/nvml_stress.c"), *map(str, SOURCES), str(stubs)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    env = {**os.environ, "HWSANDBOX_NVML_ROOT": str(root), "HWSANDBOX_NVML_REFRESH_MS": "0",
           "ASAN_OPTIONS": "detect_leaks=0", "UBSAN_OPTIONS": "halt_on_error=1",
           "TSAN_OPTIONS": "halt_on_error=1"}  # fmt: skip
    rounds = "40" if sanitizer == "thread" else "300"  # ThreadSanitizer is ~20x slower
    run = subprocess.run([str(exe), rounds], env=env, capture_output=True, text=True, timeout=600,
                         check=False)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr[-5000:]
    assert "failures 0" in run.stdout
    assert "runtime error" not in run.stderr, run.stderr[-3000:]  # UBSan's report
