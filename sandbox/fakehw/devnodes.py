"""The one policy for REAL device nodes the sandbox creates (``render --mknod``, the device
directory a runtime fills with ``sandbox mount --dev-dir``).

A node tree's device numbers come from the profile: our catalogue's (195:N for NVIDIA GPUs,
226:N for DRM cards, 259:N for NVMe namespaces...) and a profile's own ``devNodes`` with any
major:minor it likes. On the host those numbers name real drivers: 195:0 is the host's
first GPU wherever it has one, 4:64 its serial port, 21:N raw SCSI. So a real node never
carries a tree's number. It is:

- the same memory device for the five harmless ones every container has anyway (null 1:3,
  zero 1:5, full 1:7, random 1:8, urandom 1:9), so a tree's ``/dev/zero`` still reads zeros
  and a node's existing ``/dev/full`` is what we would make;
- otherwise a CHARACTER device 1:3 (``/dev/null``): openable, harmless; a block node too
  (a block 1:3 would be /dev/ram3, a real disk).

Modes are the tree's, never wider than 0660, and the caller's umask applies (no chmod past
it): nodes are root's. The FUSE tree itself keeps the tree's numbers (readers compare them
with ``/sys/dev/char/M:m``); it is mounted ``nodev``, so they open nothing.
``render --mknod --real-numbers`` is the one documented way to the tree's own numbers.
Containers get the same rule from the runtime wrapper in front of runc
(``sandbox/runtimes/oci-cpumap``): a device entry whose numbers the node lacks at that path
is made a 1:3 stand-in, whatever a device plugin or a CDI spec asked for.
"""

from __future__ import annotations

import os
import stat

from sandbox.fakehw.tree import BlockDevice, CharDevice

STAND_IN = (1, 3)  # /dev/null
HARMLESS = frozenset({(1, 3), (1, 5), (1, 7), (1, 8), (1, 9)})  # null zero full random urandom
MAX_MODE = 0o660


def real_node(entry: CharDevice | BlockDevice) -> tuple[int, int, int]:
    """(file type, rdev, mode) of the real node made for a tree's device ``entry``."""
    numbers = (entry.major, entry.minor)
    if isinstance(entry, CharDevice) and numbers in HARMLESS:
        return stat.S_IFCHR, os.makedev(*numbers), entry.mode & MAX_MODE
    return stat.S_IFCHR, os.makedev(*STAND_IN), entry.mode & MAX_MODE


def own_numbers(entry: CharDevice | BlockDevice) -> tuple[int, int, int]:
    """(file type, rdev, mode) with the tree's own numbers: ``render --real-numbers`` only."""
    ftype = stat.S_IFBLK if isinstance(entry, BlockDevice) else stat.S_IFCHR
    return ftype, os.makedev(entry.major, entry.minor), entry.mode & MAX_MODE


def is_ours(st: os.stat_result) -> bool:
    """Whether a file is a node ``real_node`` makes (what teardown may unlink)."""
    return stat.S_ISCHR(st.st_mode) and (
        os.major(st.st_rdev), os.minor(st.st_rdev)) in HARMLESS


def check_map(numbers: tuple[int, int]) -> tuple[int, int]:
    """A ``--dev-map`` value: one of the harmless memory devices, or a ValueError."""
    if numbers not in HARMLESS:
        allowed = ", ".join(f"{a}:{b}" for a, b in sorted(HARMLESS))
        raise ValueError(f"{numbers[0]}:{numbers[1]} is a real host device; the map may only "
                         f"be a harmless memory device ({allowed})")
    return numbers


def parse_map(text: str) -> tuple[int, int]:
    """A ``--dev-map MAJOR:MINOR`` argument, checked (``check_map``), or a ValueError."""
    major, sep, minor = text.partition(":")
    if not sep or not major.isdigit() or not minor.isdigit():
        raise ValueError(f"{text!r}: expected MAJOR:MINOR such as 1:3")
    return check_map((int(major), int(minor)))
