"""A thin ctypes view of NVML's C ABI, for tests and benchmarks that drive our
libnvidia-ml.so.1 directly (struct layouts as NVML publishes them; docs/nvml.md).

Also runnable: ``python -m tests.support.nvml_ctypes fuzz LIB ROOT SEQUENCES SEED`` plays random
call sequences against the library (used by tests/plugins/test_nvml.py in a subprocess, so a crash
is a failed exit status, not a dead test runner).
"""

from __future__ import annotations

import ctypes
import random
import sys
from pathlib import Path
from typing import Any

SUCCESS, UNINITIALIZED, INVALID_ARGUMENT, NOT_SUPPORTED = 0, 1, 2, 3
NOT_FOUND, INSUFFICIENT_SIZE, DRIVER_NOT_LOADED, TIMEOUT = 6, 7, 9, 10
GPU_IS_LOST, ARGUMENT_VERSION_MISMATCH, UNKNOWN = 15, 25, 999
NO_PERMISSION, IN_USE, INSUFFICIENT_RESOURCES = 4, 19, 23
EVENT_XID = 8


class PciInfo(ctypes.Structure):
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint),
                ("bus", ctypes.c_uint), ("device", ctypes.c_uint),
                ("pciDeviceId", ctypes.c_uint), ("pciSubSystemId", ctypes.c_uint),
                ("busId", ctypes.c_char * 32)]  # fmt: skip


class Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]  # fmt: skip


class EventData(ctypes.Structure):
    _fields_ = [("device", ctypes.c_void_p), ("eventType", ctypes.c_ulonglong),
                ("eventData", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                ("computeInstanceId", ctypes.c_uint)]  # fmt: skip


class Placement(ctypes.Structure):  # nvmlGpuInstancePlacement_t
    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


class GpuInstanceInfo(ctypes.Structure):  # nvmlGpuInstanceInfo_t
    _fields_ = [("device", ctypes.c_void_p), ("id", ctypes.c_uint),
                ("profileId", ctypes.c_uint), ("placement", Placement)]  # fmt: skip


class Nvml:
    """The library at ``path`` (loaded once per process, like dlopen)."""

    def __init__(self, path: str | Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.nvmlErrorString.restype = ctypes.c_char_p

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lib, name)

    def check(self, ret: int) -> None:
        if ret != SUCCESS:
            raise RuntimeError(f"NVML error {ret}: {self.lib.nvmlErrorString(ret).decode()}")

    def count(self) -> int:
        n = ctypes.c_uint()
        self.check(self.lib.nvmlDeviceGetCount_v2(ctypes.byref(n)))
        return n.value

    def handle(self, index: int) -> ctypes.c_void_p:
        h = ctypes.c_void_p()
        self.check(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(h)))
        return h

    def text(self, fn: str, h: ctypes.c_void_p, size: int = 96) -> str:
        buf = ctypes.create_string_buffer(size)
        self.check(getattr(self.lib, fn)(h, buf, size))
        return buf.value.decode()

    def uuid(self, h: ctypes.c_void_p) -> str:
        return self.text("nvmlDeviceGetUUID", h)

    def memory(self, h: ctypes.c_void_p) -> tuple[int, int]:
        """(return code, total bytes)."""
        m = Memory()
        ret = self.lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m))
        return ret, m.total

    def pci(self, h: ctypes.c_void_p) -> PciInfo:
        p = PciInfo()
        self.check(self.lib.nvmlDeviceGetPciInfo_v3(h, ctypes.byref(p)))
        return p

    def uint(self, fn: str, h: ctypes.c_void_p) -> int:
        v = ctypes.c_uint()
        self.check(getattr(self.lib, fn)(h, ctypes.byref(v)))
        return v.value


# -- fuzz ------------------------------------------------------------------------------------

_STUBS = ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperature", "nvmlDeviceGetClockInfo",
          "nvmlDeviceGetEccMode", "nvmlUnitGetCount", "nvmlDeviceGetFanSpeed")  # fmt: skip


def fuzz(lib_path: str, root: Path, sequences: int, seed: int) -> dict[str, int]:
    """Random call sequences with random arguments (valid, stale, NULL and bogus handles;
    short buffers; out-of-range indices; wrong struct versions), while the state file is
    now and then corrupted, removed and restored. Returns how often each code came back.
    Anything but a clean return is a crash of this process."""
    nv = Nvml(lib_path)
    lib = nv.lib
    rng = random.Random(seed)
    state_file = root / "proc/driver/nvidia/hwsandbox/nvml"
    good_state = state_file.read_bytes()
    codes: dict[str, int] = {}
    handles: list[Any] = [None, ctypes.c_void_p(1), ctypes.c_void_p(0xDEADBEEF)]
    sets: list[Any] = [None, ctypes.c_void_p(8)]
    inits = 0

    def note(ret: int) -> None:
        codes[str(ret)] = codes.get(str(ret), 0) + 1

    def a_handle() -> Any:
        h = rng.choice(handles)
        if h is not None and rng.random() < 0.05:  # just past a valid handle
            return ctypes.c_void_p((h.value or 0) + rng.choice((1, 8, -8, 4096)))
        return h

    def out(ctype: Any) -> Any:
        return None if rng.random() < 0.1 else ctypes.byref(ctype())

    for _ in range(sequences):
        for _ in range(rng.randint(1, 8)):
            op = rng.randrange(27)
            if op == 0:
                note(lib.nvmlInit_v2())
                inits += 1
            elif op == 1 and inits > 0:
                note(lib.nvmlShutdown())
                inits -= 1
            elif op == 2:
                h = ctypes.c_void_p()
                ret = lib.nvmlDeviceGetHandleByIndex_v2(rng.randint(-2, 10), ctypes.byref(h))
                note(ret)
                if ret == SUCCESS:
                    handles.append(h)
            elif op == 3:
                size = rng.choice((0, 1, 10, 40, 80, 96))
                buf = ctypes.create_string_buffer(max(size, 1))
                note(lib.nvmlDeviceGetUUID(a_handle(), buf if rng.random() > 0.05 else None,
                                           size))  # fmt: skip
            elif op == 4:
                buf = ctypes.create_string_buffer(96)
                note(lib.nvmlDeviceGetName(a_handle(), buf, rng.choice((0, 5, 96))))
            elif op == 5:
                note(lib.nvmlDeviceGetMemoryInfo(a_handle(), out(Memory)))
            elif op == 6:
                note(lib.nvmlDeviceGetPciInfo_v3(a_handle(), out(PciInfo)))
            elif op == 7:
                note(lib.nvmlDeviceGetCudaComputeCapability(a_handle(), out(ctypes.c_int),
                                                            out(ctypes.c_int)))  # fmt: skip
            elif op == 8:
                note(lib.nvmlDeviceGetMigMode(a_handle(), out(ctypes.c_uint),
                                              out(ctypes.c_uint)))  # fmt: skip
            elif op == 9:
                m = ctypes.c_void_p()
                ret = lib.nvmlDeviceGetMigDeviceHandleByIndex(a_handle(), rng.randint(-1, 8),
                                                              ctypes.byref(m))  # fmt: skip
                note(ret)
                if ret == SUCCESS:
                    handles.append(m)
            elif op == 10:
                gi = ctypes.c_void_p()
                note(lib.nvmlDeviceGetGpuInstanceById(a_handle(), rng.randint(0, 8),
                                                      ctypes.byref(gi)))  # fmt: skip
                info = (ctypes.c_char * 64)()
                note(lib.nvmlGpuInstanceGetInfo(gi if rng.random() > 0.2 else a_handle(),
                                                info))  # fmt: skip
                ci = ctypes.c_void_p()
                note(lib.nvmlGpuInstanceGetComputeInstanceById(gi, rng.randint(0, 2),
                                                               ctypes.byref(ci)))  # fmt: skip
                note(lib.nvmlComputeInstanceGetInfo_v2(ci, info))
            elif op == 11:
                profile = (ctypes.c_uint * 64)()
                profile[0] = rng.choice((0, 0x2000000 | 160, 0x3000000 | 168, 12345))
                note(lib.nvmlDeviceGetGpuInstanceProfileInfoV(a_handle(), rng.randint(-1, 20),
                                                              profile))  # fmt: skip
                note(lib.nvmlDeviceGetGpuInstanceProfileInfo(a_handle(), rng.randint(0, 20),
                                                             profile))  # fmt: skip
                n = ctypes.c_uint(rng.randint(0, 9))
                note(lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(
                    a_handle(), rng.randint(-1, 20), rng.choice((None, profile)),
                    rng.choice((None, ctypes.byref(n)))))
            elif op == 12:
                s = ctypes.c_void_p()
                ret = lib.nvmlEventSetCreate(ctypes.byref(s))
                note(ret)
                if ret == SUCCESS:
                    sets.append(s)
            elif op == 13:
                note(lib.nvmlDeviceRegisterEvents(a_handle(), ctypes.c_ulonglong(
                    rng.choice((8, 0xB, 0xFFFF, 1 << 40))), rng.choice(sets)))
            elif op == 14:
                ev = EventData()
                note(lib.nvmlEventSetWait_v2(rng.choice(sets), ctypes.byref(ev)
                                             if rng.random() > 0.1 else None,
                                             rng.choice((0, 1, 2))))  # fmt: skip
            elif op == 15 and len(sets) > 2:
                note(lib.nvmlEventSetFree(sets.pop(rng.randrange(len(sets)))))
            elif op == 16:
                h = ctypes.c_void_p()
                ident = rng.choice((b"GPU-", b"", b"MIG-x", b"0000:01:00.0", b"zz" * 100))
                note(lib.nvmlDeviceGetHandleByUUID(ident, ctypes.byref(h)))
                note(lib.nvmlDeviceGetHandleByPciBusId_v2(ident, ctypes.byref(h)))
            elif op == 17:
                note(getattr(lib, rng.choice(_STUBS))())
            elif op == 18:
                buf = ctypes.create_string_buffer(80)
                note(lib.nvmlSystemGetDriverVersion(buf, rng.choice((0, 3, 80))))
                note(lib.nvmlSystemGetCudaDriverVersion_v2(out(ctypes.c_int)))
            elif op == 19:
                lvl = ctypes.c_int()
                note(lib.nvmlDeviceGetTopologyCommonAncestor(a_handle(), a_handle(),
                                                             ctypes.byref(lvl)))  # fmt: skip
            elif op == 20:
                note(lib.nvmlDeviceGetAttributes_v2(a_handle(), (ctypes.c_char * 48)()))
                note(lib.nvmlDeviceIsMigDeviceHandle(a_handle(), out(ctypes.c_uint)))
                p = ctypes.c_void_p()
                note(lib.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(a_handle(),
                                                                      ctypes.byref(p)))
            elif op == 21:
                note(lib.nvmlDeviceGetSupportedEventTypes(a_handle(), out(ctypes.c_ulonglong)))
                note(lib.nvmlDeviceGetMinorNumber(a_handle(), out(ctypes.c_uint)))
            elif op == 22:  # the state file changes under the library
                choice = rng.randrange(4)
                if choice == 0:
                    state_file.write_bytes(bytes(rng.randrange(256) for _ in range(200)))
                elif choice == 1:
                    cut = rng.randrange(len(good_state))
                    state_file.write_bytes(good_state[:cut])
                elif choice == 2 and state_file.exists():
                    state_file.unlink()
                else:
                    state_file.write_bytes(good_state)
            elif op == 23:
                lib.nvmlErrorString(rng.randint(-5, 1000))
            elif op == 24:
                count = ctypes.c_uint(rng.randint(0, 4))
                arr = (ctypes.c_void_p * 8)()
                note(lib.nvmlDeviceGetGpuInstances(a_handle(), rng.randint(0, 6),
                                                   arr if rng.random() > 0.2 else None,
                                                   ctypes.byref(count)))  # fmt: skip
            elif op == 25:
                note(lib.nvmlDeviceGetCount_v2(out(ctypes.c_uint)))
            elif op == 26:  # the MIG lifecycle: random handles, profiles, placements
                gi, ci = ctypes.c_void_p(), ctypes.c_void_p()
                where = Placement(rng.randint(0, 70), rng.choice((0, 1, 2, 4, 8)))
                status = ctypes.c_int()
                call = rng.randrange(6)
                if call == 0:
                    note(lib.nvmlDeviceCreateGpuInstanceWithPlacement(
                        a_handle(), rng.randint(-1, 20),
                        ctypes.byref(where) if rng.random() > 0.1 else None, ctypes.byref(gi)))
                elif call == 1:
                    note(lib.nvmlDeviceCreateGpuInstance(a_handle(), rng.randint(-1, 20),
                                                         out(ctypes.c_void_p)))  # fmt: skip
                elif call == 2:
                    note(lib.nvmlDeviceSetMigMode(a_handle(), rng.randint(0, 2),
                                                  ctypes.byref(status)))  # fmt: skip
                elif call == 3:
                    note(lib.nvmlGpuInstanceDestroy(a_handle()))
                    note(lib.nvmlComputeInstanceDestroy(a_handle()))
                elif call == 4:
                    note(lib.nvmlGpuInstanceCreateComputeInstance(a_handle(), rng.randint(-1, 9),
                                                                  ctypes.byref(ci)))  # fmt: skip
                else:
                    n = ctypes.c_uint()
                    note(lib.nvmlDeviceGetGpuInstanceRemainingCapacity(
                        a_handle(), rng.randint(-1, 20), ctypes.byref(n)))
                    note(lib.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
                        a_handle(), rng.randint(-1, 9), ctypes.byref(n)))
    state_file.write_bytes(good_state)
    while inits > 0:
        lib.nvmlShutdown()
        inits -= 1
    return codes


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] != "fuzz":
        sys.exit("usage: python -m tests.support.nvml_ctypes fuzz LIB ROOT SEQUENCES SEED")
    result = fuzz(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    print(" ".join(f"{k}:{v}" for k, v in sorted(result.items(), key=lambda kv: int(kv[0]))))
