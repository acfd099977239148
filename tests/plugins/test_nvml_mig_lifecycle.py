"""Dynamic MIG through our NVML (docs/nvml.md, "Dynamic MIG"): GPU and compute instances
created and destroyed by NVML calls in this process reach every reader of the live node at
once (nvidia-smi and NVML in other processes, the driver's capabilities, /dev/nvidia-caps,
the control API's ``get`` and ``sandbox fault list``), survive a restart of the node's
server, and are refused with the codes the real library returns; random create/destroy
sequences from several threads never leave a reader an inconsistent view."""

from __future__ import annotations

import ctypes
import random
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandbox.fakehw.control import ControlClient
from tests.plugins.test_nvidia_smi import ok, smi
from tests.support import nvml_ctypes as N
from tests.support.paths import REPO
from tests.support.thirdparty import served_node, short_dir

pytestmark = [pytest.mark.root, pytest.mark.fuse]

NODE = "mig-worker"
# NVML's GPU-instance profile ids (by compute slices) of mig-partitions' A100 80GB
P1G, P2G, P3G, P7G = 0, 1, 2, 4


@contextmanager
def served(base: Path) -> Iterator[Path]:
    """mig-partitions' node served live at base/root, its state kept in base."""
    with served_node("mig-partitions.yaml", NODE, base) as live:
        yield live.root


def gpu0(nvml: N.Nvml) -> ctypes.c_void_p:
    return nvml.handle(0)


def listed(nvml: N.Nvml, h: ctypes.c_void_p) -> tuple[int, dict[int, tuple[int, int, int]]]:
    """NVML's return code and gi id -> (profile id, start, size) of the GPU's instances; an
    instance destroyed by another thread between listing and reading gives that code."""
    out = {}
    for pid in (P1G, P2G, P3G, P7G):
        arr = (ctypes.c_void_p * 16)()
        n = ctypes.c_uint(16)
        ret = nvml.nvmlDeviceGetGpuInstances(h, pid, arr, ctypes.byref(n))
        if ret != N.SUCCESS:
            return ret, out
        for k in range(n.value):
            info = N.GpuInstanceInfo()
            ret = nvml.nvmlGpuInstanceGetInfo(ctypes.c_void_p(arr[k]), ctypes.byref(info))
            if ret != N.SUCCESS:
                return ret, out
            out[info.id] = (info.profileId, info.placement.start, info.placement.size)
    return N.SUCCESS, out


def instances(nvml: N.Nvml, h: ctypes.c_void_p) -> dict[int, tuple[int, int, int]]:
    ret, out = listed(nvml, h)
    nvml.check(ret)
    return out


def gi_handle(nvml: N.Nvml, h: ctypes.c_void_p, gi: int) -> ctypes.c_void_p:
    out = ctypes.c_void_p()
    nvml.check(nvml.nvmlDeviceGetGpuInstanceById(h, gi, ctypes.byref(out)))
    return out


def ci_handle(nvml: N.Nvml, gih: ctypes.c_void_p) -> ctypes.c_void_p:
    out = ctypes.c_void_p()
    nvml.check(nvml.nvmlGpuInstanceGetComputeInstanceById(gih, 0, ctypes.byref(out)))
    return out


def create(nvml: N.Nvml, h: ctypes.c_void_p, pid: int, start: int | None, size: int = 0
           ) -> tuple[int, ctypes.c_void_p]:  # fmt: skip
    gih = ctypes.c_void_p()
    if start is None:
        ret = nvml.nvmlDeviceCreateGpuInstance(h, pid, ctypes.byref(gih))
    else:
        where = N.Placement(start, size)
        ret = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, pid, ctypes.byref(where),
                                                            ctypes.byref(gih))
    return ret, gih


def empty_gpu(nvml: N.Nvml, h: ctypes.c_void_p) -> None:
    """Destroy every instance of the GPU: compute instances, then GPU instances."""
    for gi in instances(nvml, h):
        gih = gi_handle(nvml, h, gi)
        cih = ctypes.c_void_p()
        if nvml.nvmlGpuInstanceGetComputeInstanceById(gih, 0, ctypes.byref(cih)) == N.SUCCESS:
            nvml.check(nvml.nvmlComputeInstanceDestroy(cih))
        nvml.check(nvml.nvmlGpuInstanceDestroy(gih))


def mig_device_uuids(nvml: N.Nvml, h: ctypes.c_void_p) -> list[str]:
    out = []
    for k in range(8):
        m = ctypes.c_void_p()
        if nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k, ctypes.byref(m)) != N.SUCCESS:
            break
        out.append(nvml.uuid(m))
    return out


def caps_of(root: Path, minor: int) -> set[str]:
    base = root / f"proc/driver/nvidia/capabilities/gpu{minor}/mig"
    return {str(p.relative_to(base).parent) for p in base.rglob("access")}


def test_instances_made_by_nvml_reach_every_reader_and_survive_a_restart(
    nvml: N.Nvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    with short_dir("hwm-") as base:
        with served(base) as root:
            monkeypatch.setenv("HWSANDBOX_NVML_ROOT", str(root))
            monkeypatch.delenv("HWSANDBOX_NVML_WATCH", raising=False)
            nvml.check(nvml.nvmlInit_v2())
            h = gpu0(nvml)
            minor = nvml.uint("nvmlDeviceGetMinorNumber", h)
            have = instances(nvml, h)
            assert sorted(p for p, _, _ in have.values()) == [P1G, P1G, P2G, P3G]
            gi_any = next(iter(have))
            # without the control socket no process may change MIG
            assert nvml.nvmlGpuInstanceDestroy(gi_handle(nvml, h, gi_any)) == N.NO_PERMISSION
            nvml.check(nvml.nvmlShutdown())

            monkeypatch.setenv("HWSANDBOX_NVML_WATCH", str(base / "control.sock"))
            nvml.check(nvml.nvmlInit_v2())
            h = gpu0(nvml)
            # a GPU instance holding its compute instance is in use
            assert nvml.nvmlGpuInstanceDestroy(gi_handle(nvml, h, gi_any)) == N.IN_USE
            status = ctypes.c_int(-1)
            nvml.check(nvml.nvmlDeviceSetMigMode(h, 0, ctypes.byref(status)))
            assert status.value == N.IN_USE  # NVML: activation status, not the return
            empty_gpu(nvml, h)
            assert instances(nvml, h) == {}
            assert mig_device_uuids(nvml, h) == []
            assert caps_of(root, minor) == set()

            ret, gih = create(nvml, h, P1G, 2, 1)
            nvml.check(ret)
            info = N.GpuInstanceInfo()
            nvml.check(nvml.nvmlGpuInstanceGetInfo(gih, ctypes.byref(info)))
            gi = info.id
            assert (info.profileId, info.placement.start, info.placement.size) == (P1G, 2, 1)
            assert caps_of(root, minor) == {f"gi{gi}"}  # no compute instance yet
            assert mig_device_uuids(nvml, h) == []
            cih = ctypes.c_void_p()
            nvml.check(nvml.nvmlGpuInstanceCreateComputeInstance(gih, P1G, ctypes.byref(cih)))
            assert caps_of(root, minor) == {f"gi{gi}", f"gi{gi}/ci0"}
            [uuid] = mig_device_uuids(nvml, h)

            # conflicts, as the real library refuses them
            assert create(nvml, h, P2G, 2, 2)[0] == N.INSUFFICIENT_RESOURCES  # overlaps
            assert create(nvml, h, P2G, 1, 2)[0] == N.INVALID_ARGUMENT  # not a placement
            assert create(nvml, h, P1G, 2, 1)[0] == N.INSUFFICIENT_RESOURCES  # taken
            assert nvml.nvmlGpuInstanceCreateComputeInstance(
                gih, P1G, ctypes.byref(ctypes.c_void_p())) == N.INSUFFICIENT_RESOURCES
            left = ctypes.c_uint()
            nvml.check(nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, P3G, ctypes.byref(left)))
            assert left.value == 1  # 3g.40gb fits at 4 only
            ret, big = create(nvml, h, P3G, None)
            nvml.check(ret)
            assert instances(nvml, h)[gi] == (P1G, 2, 1)
            assert sorted(instances(nvml, h).values()) == [(P1G, 2, 1), (P3G, 4, 4)]

            # every other reader sees them now
            listed = ok(smi(root, "-L"))
            assert any(uuid in line for line in listed), listed
            header, *rows = ok(smi(root, "mig", "-lgi"))
            gis = {(r.split()[0], r.split()[3], r.split()[-1]) for r in rows}
            assert ("0", str(gi), "2:1") in gis
            assert ("0", next(
                str(k) for k, v in instances(nvml, h).items() if v[0] == P3G), "4:4") in gis
            gi_minor = 3 + minor * 15 * 9 + gi * 9
            for m in (gi_minor, gi_minor + 1):
                assert (root / f"dev/nvidia-caps/nvidia-cap{m}").exists()
            with ControlClient(base / "control.sock") as client:
                mig = client.devices()["gpu0"]["mig"]
            assert {(g["gi"], g["profile"], g["start"], g["ci"]) for g in mig} >= \
                {(gi, "1g.10gb", 2, True)}  # fmt: skip
            listing = subprocess.run(
                [sys.executable, "-m", "sandbox", "fault", "--socket",
                 str(base / "control.sock"), "list"], capture_output=True, text=True, cwd=REPO,
                timeout=60, check=True).stdout  # fmt: skip
            row = next(line for line in listing.splitlines() if re.search(r"\bgpu0\b", line))
            assert f"gi{gi} 1g.10gb@2" in row, listing
            assert "3g.40gb@4 (no CI)" in row, listing
            nvml.check(nvml.nvmlShutdown())

        # the node's server restarts: the instances are still there
        with served(base) as root:
            monkeypatch.setenv("HWSANDBOX_NVML_ROOT", str(root))
            nvml.check(nvml.nvmlInit_v2())
            h = gpu0(nvml)
            assert sorted(instances(nvml, h).values()) == [(P1G, 2, 1), (P3G, 4, 4)]
            assert mig_device_uuids(nvml, h) == [uuid]
            # destroyed in the right order, the GPU is empty again and MIG mode can go off
            nvml.check(nvml.nvmlComputeInstanceDestroy(ci_handle(nvml, gi_handle(nvml, h, gi))))
            assert nvml.nvmlComputeInstanceDestroy(cih) == N.INVALID_ARGUMENT  # stale handle
            empty_gpu(nvml, h)
            assert not any(uuid in line for line in ok(smi(root, "-L")))
            assert caps_of(root, minor) == set()
            nvml.check(nvml.nvmlDeviceSetMigMode(h, 0, ctypes.byref(status)))
            assert status.value == N.SUCCESS
            cur, pend = ctypes.c_uint(9), ctypes.c_uint(9)
            nvml.check(nvml.nvmlDeviceGetMigMode(h, ctypes.byref(cur), ctypes.byref(pend)))
            assert (cur.value, pend.value) == (0, 0)
            assert create(nvml, h, P1G, None)[0] == N.NOT_SUPPORTED  # MIG mode is off
            nvml.check(nvml.nvmlDeviceSetMigMode(h, 1, ctypes.byref(status)))
            assert instances(nvml, h) == {}
            nvml.check(nvml.nvmlShutdown())


def test_concurrent_creates_and_destroys_keep_every_reader_consistent(
    nvml: N.Nvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four threads create instances of random profiles and placements on the same two GPUs
    (and destroy their own) while reading: every call returns a code the real library
    could, no two listed instances ever share a memory slice, and the compute slices in use
    never exceed the GPU's."""
    sizes = {P1G: (1, 1), P2G: (2, 2), P3G: (4, 3), P7G: (8, 7)}  # memory, compute
    allowed = {N.SUCCESS, N.INSUFFICIENT_RESOURCES, N.INVALID_ARGUMENT}  # a busy or bad place
    problems: list[str] = []
    with short_dir("hwm-") as base, served(base) as root:
        monkeypatch.setenv("HWSANDBOX_NVML_ROOT", str(root))
        monkeypatch.setenv("HWSANDBOX_NVML_WATCH", str(base / "control.sock"))
        nvml.check(nvml.nvmlInit_v2())
        handles = [nvml.handle(0), nvml.handle(1)]

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            mine: list[tuple[ctypes.c_void_p, int]] = []  # (GPU, gi) this thread made
            for _ in range(60):
                h = rng.choice(handles)
                ret, have = listed(nvml, h)
                if ret != N.SUCCESS:  # an instance destroyed between listing and reading
                    if ret != N.INVALID_ARGUMENT:
                        problems.append(f"listing: {ret}")
                    continue
                used = [s for p, start, _ in have.values()
                        for s in range(start, start + sizes[p][0])]
                if len(used) != len(set(used)) or \
                        sum(sizes[p][1] for p, _, _ in have.values()) > 7:
                    problems.append(f"inconsistent: {have}")
                if rng.random() < 0.5 or not mine:
                    pid = rng.choice(list(sizes))
                    start = rng.choice([None, 0, 1, 2, 4, 6])
                    what = f"create {pid}@{start}"
                    ret, gih = create(nvml, h, pid, start, sizes[pid][0])
                    if ret == N.SUCCESS:
                        info = N.GpuInstanceInfo()
                        nvml.check(nvml.nvmlGpuInstanceGetInfo(gih, ctypes.byref(info)))
                        mine.append((h, info.id))
                        what += " ci"
                        ret = nvml.nvmlGpuInstanceCreateComputeInstance(
                            gih, pid, ctypes.byref(ctypes.c_void_p()))
                else:
                    what = "destroy"
                    h, gi = mine.pop(rng.randrange(len(mine)))
                    gih = gi_handle(nvml, h, gi)
                    ret = nvml.nvmlComputeInstanceDestroy(ci_handle(nvml, gih))
                    if ret == N.SUCCESS:
                        ret = nvml.nvmlGpuInstanceDestroy(gih)
                if ret not in allowed:
                    problems.append(f"{what}: unexpected return {ret}")

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads)
        # the tree and NVML agree at the end: one capability per instance and compute instance
        for h in handles:
            minor = nvml.uint("nvmlDeviceGetMinorNumber", h)
            have = instances(nvml, h)
            assert {c for c in caps_of(root, minor) if "/" not in c} == \
                {f"gi{g}" for g in have}  # fmt: skip
        nvml.check(nvml.nvmlShutdown())
    assert problems == []
