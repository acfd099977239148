"""Our NVML (sandbox/nvml) on a live FUSE mount of 8gpu-2numa, as ratios against baselines
measured in the same run.

    sequence   nvmlDeviceGetHandleByIndex + GetUUID + GetMemoryInfo for all 8 GPUs, in one
               call sequence (ctypes), at the default state refresh (50 ms) and at 0 (the
               state file re-read on every call); baseline: the same tree files (8
               information files + the state file) read the way the library reads them:
               open, read to EOF, close, unbuffered (a buffered Python open also asks the
               FUSE server isatty(), a round trip the library never makes)
    init       nvmlInit + nvmlShutdown (scans the tree); same baseline
    fault      control-socket health flip -> nvmlEventSetWait returns the Xid, with the
               default 50 ms timer and with HWSANDBOX_NVML_WATCH (the control socket's
               change stream wakes the poller); baseline: the control call alone (the
               flip's own round trip, tree rebuild included)
    plugin     (--plugin) aer-fatal on one GPU -> NVIDIA's device plugin (v0.18.0, built by
               scripts/build-plugins) reports it unhealthy to the kubelet harness, once per
               GPU (it never marks one healthy again); same baseline

Run: python benchmarks/bench_nvml.py [--rounds 2000] [--flips 10] [--plugin]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sandbox.nvml import build  # noqa: E402
from tests.support import nvml_ctypes as N  # noqa: E402
from tests.support.thirdparty import (  # noqa: E402
    KUBELET_PLUGIN_DIR,
    Bind,
    LiveNode,
    Tmpfs,
    in_private_mounts,
    live_node,
    short_dir,
)


def plugin_latencies(live: LiveNode, lib_dir: Path) -> list[float]:
    """Seconds from each GPU's aer-fatal to NVIDIA's plugin reporting it unhealthy."""
    import subprocess

    from sandbox.kubelet import DeviceManager

    binary = subprocess.run([str(REPO / "scripts/build-plugins"), "nvidia-device-plugin"],
                            capture_output=True, text=True, check=True).stdout.split()[-1]
    out = []
    with short_dir("bnv-") as base, DeviceManager(base / "dp") as dm:
        argv = in_private_mounts(
            [str(binary)],
            [Tmpfs("/var/lib"), Bind(str(dm.directory), KUBELET_PLUGIN_DIR),
             Bind(str(live.root / "sys"), "/sys"), Bind(str(live.root / "dev"), "/dev")],
        )  # fmt: skip
        env = {**os.environ, "LD_LIBRARY_PATH": str(lib_dir),
               "HWSANDBOX_NVML_ROOT": str(live.root)}  # fmt: skip
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            dm.wait_for(lambda s: s.allocatable("nvidia.com/gpu") == 8, 30, "8 GPUs")
            with live.client() as client:
                for k in range(8):
                    t0 = time.perf_counter()
                    client.health(f"gpu{k}", "unhealthy", "aer-fatal")
                    left = 7 - k
                    dm.wait_for(lambda s: s.allocatable("nvidia.com/gpu") == left,  # noqa: B023
                                30, "one more unhealthy")  # fmt: skip
                    out.append(time.perf_counter() - t0)
        finally:
            proc.terminate()
            proc.wait(10)
    return out


def per_call(fn: Callable[[], object], rounds: int) -> tuple[float, float]:
    """(median, p95) seconds of ``fn`` over ``rounds`` runs."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    out.sort()
    return statistics.median(out), out[int(0.95 * (len(out) - 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--flips", type=int, default=10)
    ap.add_argument("--plugin", action="store_true", help="also time NVIDIA's plugin")
    args = ap.parse_args()
    lib_path = build()
    nv = N.Nvml(lib_path)
    rows: list[tuple[str, float, float, str]] = []
    with live_node("8gpu-2numa.yaml", "gpu-worker") as live:
        os.environ["HWSANDBOX_NVML_ROOT"] = str(live.root)
        gpus_dir = live.root / "proc/driver/nvidia/gpus"
        infos = sorted(gpus_dir.glob("*/information"))
        state = live.root / "proc/driver/nvidia/hwsandbox/nvml"

        def plain() -> None:
            for path in (*infos, state):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NOCTTY)
                try:
                    while os.read(fd, 1 << 16):
                        pass
                finally:
                    os.close(fd)

        def sequence() -> None:
            h = ctypes.c_void_p()
            buf = ctypes.create_string_buffer(96)
            mem = N.Memory()
            for i in range(8):
                nv.lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h))
                nv.lib.nvmlDeviceGetUUID(h, buf, 96)
                nv.lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(mem))

        base_med, base_p95 = per_call(plain, args.rounds)
        rows.append(("unbuffered read of the tree files (baseline)", base_med, base_p95, "1.00"))
        for refresh in ("50", "0"):
            os.environ["HWSANDBOX_NVML_REFRESH_MS"] = refresh
            nv.check(nv.nvmlInit_v2())
            sequence()
            med, p95 = per_call(sequence, args.rounds)
            nv.check(nv.nvmlShutdown())
            rows.append((f"NVML sequence, refresh {refresh} ms", med, p95, f"{med / base_med:.2f}"))

        def init_cycle() -> None:
            nv.check(nv.nvmlInit_v2())
            nv.check(nv.nvmlShutdown())

        med, p95 = per_call(init_cycle, max(50, args.rounds // 20))
        rows.append(("nvmlInit + nvmlShutdown", med, p95, f"{med / base_med:.2f}"))

        def flip_latencies(watch: bool) -> tuple[list[float], list[float]]:
            """(fault -> event, control call) seconds, with the default 50 ms timer and,
            if ``watch``, the control socket's change stream waking the poller."""
            os.environ["HWSANDBOX_NVML_REFRESH_MS"] = "50"
            os.environ["HWSANDBOX_NVML_WATCH"] = str(live.control) if watch else ""
            nv.check(nv.nvmlInit_v2())
            evset = ctypes.c_void_p()
            nv.check(nv.nvmlEventSetCreate(ctypes.byref(evset)))
            for i in range(8):
                nv.check(nv.nvmlDeviceRegisterEvents(nv.handle(i), ctypes.c_ulonglong(8), evset))
            ev = N.EventData()
            flips, calls = [], []
            with live.client() as client:
                for k in range(args.flips * 2):
                    healthy = k % 2 == 1
                    t0 = time.perf_counter()
                    client.health("gpu3", "healthy" if healthy else "unhealthy",
                                  None if healthy else "aer-fatal")  # fmt: skip
                    calls.append(time.perf_counter() - t0)
                    if healthy:  # recoveries shorter than the 50 ms poll can go unseen
                        time.sleep(0.2)
                    else:
                        nv.check(nv.nvmlEventSetWait_v2(evset, ctypes.byref(ev), 10_000))
                        flips.append(time.perf_counter() - t0)
                        assert ev.eventData == 48
            nv.check(nv.nvmlEventSetFree(evset))
            nv.check(nv.nvmlShutdown())
            return flips, calls

        timer_flips, calls = flip_latencies(watch=False)
        watch_flips, more_calls = flip_latencies(watch=True)
        call_med = statistics.median(calls + more_calls)
        rows.append(("control health call (baseline)", call_med, max(calls + more_calls),
                     "1.00"))  # fmt: skip
        for name, flips in (("fault -> Xid event, 50 ms timer", timer_flips),
                            ("fault -> Xid event, control-socket watch", watch_flips)):
            flip_med = statistics.median(flips)
            rows.append((name, flip_med, max(flips), f"{flip_med / call_med:.2f}"))
        for k in range(8):  # healthy again before the plugin starts
            with live.client() as client:
                client.health(f"gpu{k}", "healthy")
        if args.plugin:
            lat = plugin_latencies(live, lib_path.parent)
            med = statistics.median(lat)
            rows.append(("fault -> NVIDIA plugin reports unhealthy", med, max(lat),
                         f"{med / call_med:.2f}"))  # fmt: skip

    print(f"{'measurement':44} {'median':>10} {'p95/max':>10} {'ratio':>7}")
    for name, med, p95, ratio in rows:
        print(f"{name:44} {med * 1e3:8.3f}ms {p95 * 1e3:8.3f}ms {ratio:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
