"""``sandbox capture`` past what a profile holds (issue 21 item 11).

A profile's node holds at most ``limits.MAX_CPUS`` logical CPUs (sockets <= 16, cores per
socket <= 512, threads per core <= 8), ``limits.MAX_DEVICES`` devices and
``limits.MAX_FUNCTIONS`` PCI functions. A machine past one of them is refused with one
``CaptureError`` naming the root, what was counted where, and the limit: never captured
as something smaller (5,000 CPUs were written as 512), and a PCI directory far past the
limit is refused from its names alone, before any function is read (65,536 entries read
for 106 s before an unclear resolver error). Real files in ``tmp_path``; nothing mocked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.capture import CaptureError, capture
from sandbox.profile import load_profile_text
from sandbox.profile.resolve import limits
from tests.capture.test_capture_hostile import CPU, DEVICE, PCI, _machine, _write


def _cpus(root: Path, packages: list[list[int]]) -> int:
    """CPUs numbered as the tree numbers them: ``packages[p]`` lists each core's thread
    count; returns how many CPUs there are."""
    cpus: list[tuple[int, int, int]] = []  # (package, core, thread)
    width = max(max(p) for p in packages)
    for t in range(width):
        for p, cores in enumerate(packages):
            cpus += [(p, c, t) for c, n in enumerate(cores) if t < n]
    siblings: dict[tuple[int, int], list[int]] = {}
    for cpu, (p, c, _) in enumerate(cpus):
        siblings.setdefault((p, c), []).append(cpu)
    for cpu, (p, c, _) in enumerate(cpus):
        topo = root / CPU / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True, exist_ok=True)
        (topo / "physical_package_id").write_text(f"{p}\n")
        (topo / "core_id").write_text(f"{c}\n")
        (topo / "thread_siblings_list").write_text(",".join(map(str, siblings[p, c])) + "\n")
    _write(root / CPU / "online", f"0-{len(cpus) - 1}\n")
    return len(cpus)


def _functions(root: Path, count: int) -> None:
    """``count`` PCI functions, all links to the machine's one generic function (what is
    read is the same for each; only the names differ, as on a machine with many)."""
    for k in range(1, count):
        bus, rest = divmod(k, 256)
        address = f"0000:{bus:02x}:{rest >> 3:02x}.{rest & 7}"
        os.symlink(f"../../../{DEVICE[4:]}", root / PCI / address)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    machine = tmp_path / "root"
    _machine(machine)
    return machine


def test_five_thousand_cpus_are_refused_not_captured_as_512(root: Path) -> None:
    n = _cpus(root, [[1] * 5000])
    with pytest.raises(CaptureError) as err:
        capture(root)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{root}: {n} online CPUs ")
    assert f"{CPU}/online" in message
    assert f"a profile holds at most {limits.MAX_CPUS}" in message


def test_more_cores_per_package_than_a_socket_holds_are_refused(root: Path) -> None:
    """600 CPUs fit the CPU limit, but not one socket (``coresPerSocket`` <= 512)."""
    _cpus(root, [[1] * 600])
    with pytest.raises(CaptureError) as err:
        capture(root)
    assert str(err.value) == (f"{root}: 600 cores in package 0 under {CPU} (core_id); a "
                              "profile's coresPerSocket is at most 512")


def test_an_uneven_topology_past_the_cpu_limit_is_refused(root: Path) -> None:
    """514 CPUs, but captured evenly as 2 sockets x 512 cores x 2 threads: 2048."""
    _cpus(root, [[2] + [1] * 511, [1]])
    with pytest.raises(CaptureError) as err:
        capture(root)
    assert str(err.value) == (
        f"{root}: 514 online CPUs under {CPU} with an uneven topology (2 packages, up to "
        f"512 cores and 2 threads each) would be captured as 2 x 512 x 2 = 2048 logical "
        f"CPUs; a profile holds at most {limits.MAX_CPUS}")


def test_the_largest_cpu_count_a_profile_holds_is_captured_exactly(root: Path) -> None:
    _cpus(root, [[2] * 256, [2] * 256])
    result = capture(root)
    cpu = result.profile["nodes"][0]["cpu"]
    assert (cpu["sockets"], cpu["coresPerSocket"], cpu["threadsPerCore"]) == (2, 256, 2)
    load_profile_text(result.text, "<capture>")


def test_a_pci_directory_far_past_the_limit_is_refused_from_its_names(root: Path) -> None:
    """65,536 entries: the names are counted and refused before one function is read (its
    entries here are dangling links; reading them would capture no device at all)."""
    for k in range(1 << 16):
        bus, rest = divmod(k, 256)
        entry = root / PCI / f"0000:{bus:02x}:{rest >> 3:02x}.{rest & 7}"
        if not entry.is_symlink():  # the machine's own function
            os.symlink("../../../devices/nowhere", entry)
    with pytest.raises(CaptureError) as err:
        capture(root)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{root}: 65536 PCI functions under {PCI}; ")
    assert f"a profile holds at most {limits.MAX_FUNCTIONS}" in message


def test_more_functions_than_a_profile_holds_are_refused(root: Path) -> None:
    _functions(root, limits.MAX_FUNCTIONS + 1)
    with pytest.raises(CaptureError) as err:
        capture(root)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{root}: more than {limits.MAX_FUNCTIONS} PCI functions "
                              f"(not bridges or SR-IOV VFs) under {PCI}; ")
    assert message.endswith(f"a profile holds at most {limits.MAX_FUNCTIONS} per node")


def test_more_devices_than_a_profile_holds_are_refused(root: Path) -> None:
    _functions(root, limits.MAX_DEVICES + 1)
    with pytest.raises(CaptureError) as err:
        capture(root)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{root}: {limits.MAX_DEVICES + 1} PCI devices under {PCI}")
    assert message.endswith(f"a profile holds at most {limits.MAX_DEVICES} per node")


def test_as_many_devices_as_a_profile_holds_are_captured(root: Path) -> None:
    _functions(root, limits.MAX_DEVICES)
    result = capture(root)
    devices = result.profile["nodes"][0]["devices"]
    assert sum(d.get("count", 1) for d in devices) == limits.MAX_DEVICES
    load_profile_text(result.text, "<capture>")


def test_renames_elsewhere_on_the_machine_lose_no_function(root: Path, tmp_path: Path) -> None:
    """Every PCI link is ``../../../devices/...``: a confined lookup of ``..`` fails with
    EAGAIN when anything on the machine renames meanwhile. A process renaming a file in a
    loop beside the capture (as other tests and builds do) must not lose functions."""
    _functions(root, 300)
    quiet = capture(root).profile["nodes"]
    spot = tmp_path / "spot"
    spot.write_text("")
    renamer = subprocess.Popen([sys.executable, "-c", (
        "import os, sys\n"
        "a, b = sys.argv[1], sys.argv[1] + '.moved'\n"
        "while True:\n    os.rename(a, b)\n    os.rename(b, a)\n"), str(spot)])
    try:
        for _ in range(3):
            assert capture(root).profile["nodes"] == quiet
    finally:
        renamer.kill()
        renamer.wait()
