"""``capture``: read a machine's /sys and /proc into a hardware profile (``sandbox capture``).

    capture(root="/") -> Capture(text, profile, left_out)
    write_capture(capture, path, force=False)

``root`` is a directory holding ``sys/`` and ``proc/``: ``/`` for the host, or a copy or
a ``sandbox render`` output. Only files are read; nothing below ``root`` is written.

What is read, and how it maps to the profile (sandbox/profile/model.py):

    proc/cpuinfo                       cpu.vendor, model, family, modelNumber, mhz
    sys/devices/system/cpu/cpuN/topology  cpu.sockets, coresPerSocket, threadsPerCore
    sys/devices/system/node/nodeN/     numa.nodes[]: cpus (cpulist), memory (meminfo
                                       MemTotal), hugepages (nr_hugepages), distances
    sys/bus/pci/devices/*              devices[]: ids, class, numa_node, driver, SR-IOV
                                       (sriov_totalvfs, sriov_numvfs), netdevs (MAC, speed)
                                       numa_node -1 (no affinity): ``numaNode: none``
    sys/bus/pci/devices/0000:00:00.0   pci.rootComplex: the host bridge function's ids
                                       (class 0x060000; the machine's own, not a device)

PCI functions become the device types the profile knows when the catalogue
(sandbox/profile/catalogue.py) has their vendor:device id and class: GPUs (NVIDIA, AMD,
Intel), NICs (class 02; the functions of one slot are its ports), FPGAs, NVMe drives
(class 010802; namespaces, capacity and block size from their disks); every other
function is a ``generic`` device with its raw ids. Bridges (class 06: host bridges, root
and switch ports, ISA bridges; but not 0680 "other bridge", which NVSwitches report) are
not devices: the resolver plans its own. SR-IOV VFs
are counted on their PF (``numVFs``), not captured as devices.

PCI addresses are left to the resolver when its plan gives every function the address it
has on the machine (a tree we rendered captures back to the same profile); otherwise the
machine's addresses are kept as ``pciAddresses``. The output is validated (loaded and
resolved) before it is returned, and its header comment lists what was left out.

A machine past what a profile holds (logical CPUs and the topology's sockets, cores and
threads, NUMA nodes, PCI devices and functions, memory) is refused with one
``CaptureError`` naming the root, what was counted where, and the limit; never captured
as a smaller machine. The counts come first: a PCI directory far past the limit is
refused from its names, before any function is read.

One concern per module; this one puts them together (``capture``) and validates:

    reading   the root's files (regular files only, never written), each PCI function's
              sysfs directory, ``CaptureError``
    cpus      CPU model and topology, NUMA nodes (CPUs, memory, hugepages, distances),
              swap, the DMI identity
    devices   PCI functions as GPUs, NICs, FPGAs, NVMe drives or generic devices; bridges
              and VFs left out; identical entries merged with ``count``
    writing   the commented YAML document, ``Capture``, ``write_capture``
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from sandbox import __version__
from sandbox.capture.cpus import read_cpus, read_distances, read_numa, read_swap, read_system
from sandbox.capture.devices import Entry, Hex, merge, read_pci, root_complex
from sandbox.capture.reading import Root, check_root, clean_text, hostname
from sandbox.capture.writing import (
    Capture,
    Doc,
    host_bridges,
    plain,
    sanitize_name,
    write_capture,
)
from sandbox.errors import CaptureError, ProfileError
from sandbox.profile import catalogue, load_profile_text

__all__ = ["Capture", "CaptureError", "capture", "write_capture"]


def _planned_matches(text: str, entries: list[Entry]) -> bool:
    """Whether the resolver, left to plan, puts every function where the machine has it."""
    try:
        loaded = load_profile_text(text, "<capture>")
    except ProfileError:
        return False
    planned = {(f.address, f.vendor_id, f.device_id, f.class_code)
               for d in loaded.cluster.nodes[0].devices for f in d.functions}
    real = {(f.address, f.vendor, f.device, f.class_code) for e in entries for f in e.functions}
    return planned == real



def capture(root: str | os.PathLike[str] = "/", name: str | None = None,
            node_name: str | None = None, now: datetime.datetime | None = None) -> Capture:
    """Read ``root``'s sys/ and proc/ into a validated, commented profile."""
    r = Root(root)
    check_root(r)
    left_out: list[str] = []
    cpus = read_cpus(r, left_out)
    numa_nodes = read_numa(r, cpus, left_out)
    distances = read_distances(r, len(numa_nodes), left_out)
    raw_entries, fns = read_pci(r, len(numa_nodes), left_out)
    entries = merge(raw_entries)
    host = hostname(r)
    profile_name = sanitize_name(name or host or "captured")
    node = sanitize_name(node_name or host or "captured")
    stamp = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    where = clean_text(os.path.abspath(str(root)), "?", 128)  # a header line: one line
    description = f"captured from {where}" + (f" (host {host})" if host else "") + f" at {stamp}"
    bridges = host_bridges(r, fns, numa_nodes)
    own = root_complex(fns)
    vendor = str(cpus.fields["vendor"])
    complex_ids = None
    if own is not None and (own.vendor, own.device) != catalogue.root_complex(vendor):
        complex_ids = {"vendorId": Hex(own.vendor, 4), "deviceId": Hex(own.device, 4)}
    elif own is None and not any(f.address == "0000:00:00.0" for f in fns):
        left_out.append("no host bridge function at 0000:00:00.0: the tree renders the CPU "
                        "vendor's on host bridge pci0000:00")
    extra: dict[str, Any] = {}
    swap = read_swap(r)
    if swap is not None:
        extra["swap"] = swap
    system = read_system(r)
    if system is not None:
        extra["system"] = system
    doc = Doc(profile_name, node, clean_text(description, "captured"), cpus.fields, numa_nodes,
               distances, bridges, entries, False, extra, complex_ids)
    addresses_note = "PCI addresses: the resolver's plan gives every device its address here"
    addresses = "machine"
    if not _planned_matches(doc.yaml([]), entries):
        # Keep the machine's addresses: with its host bridges if the profile takes them.
        kept = [Doc(**{**doc.__dict__, "with_addresses": True, "host_bridges": hb})
                for hb in ([bridges, None] if bridges is not None else [None])]
        problems: list[str | None] = []
        for k in kept:  # the first that validates (each check parses a whole profile)
            problems.append(_problem(k.yaml([])))
            if problems[-1] is None:
                break
        ok = [k for k, problem in zip(kept, problems, strict=False) if problem is None]
        if ok:
            doc = ok[0]
            addresses_note = ("PCI addresses: kept as pciAddresses (the resolver's own plan "
                              "differs); the devices sit directly on their root bus in the "
                              "tree, without the machine's root ports")
        else:
            if _problem(doc.yaml([])) is not None:
                doc = Doc(**{**doc.__dict__, "host_bridges": None})
            addresses = "planned"
            addresses_note = (f"PCI addresses: planned by the resolver (the machine's do not "
                              f"fit a profile: {problems[-1]})")
    left_out.insert(0, addresses_note)
    header = [
        "Hardware profile captured by `sandbox capture` (hw-sandbox " + __version__ + ")",
        f"  from: {where}" + (f" (host {host})" if host else ""),
        f"  at:   {stamp}",
        "Read: proc/cpuinfo, sys/devices/system/cpu (topology), sys/devices/system/node",
        "(cpulist, meminfo, hugepages, distance), proc/meminfo (SwapTotal), DMI",
        "(sys/devices/virtual/dmi/id), sys/bus/pci/devices (ids, class, numa_node,",
        "driver, SR-IOV, netdevs, NVMe namespaces, DRM nodes, fatal AER errors).",
        "Check it: sandbox validate FILE; see it: sandbox render FILE --out DIR.",
        "",
        "Left out or changed (the profile cannot say it, or capture does not read it):",
        "  - not read: CPU caches and flags, IOMMU groups, DMI serials and UUID, memory",
        "    blocks, block devices other than NVMe namespaces, GPU memory and partitions,",
        "    NIC link state, generic devices' /dev nodes, labels and kubelet settings",
        "  - generic devices' subsystem ids and revisions (the tree writes the vendor id",
        "    and 0); each device's real ids are in the comment above it",
    ]
    for note in left_out:
        header += _wrap(note)
    text = doc.yaml(header)
    problem = _problem(text)
    if problem is not None:  # a bug: every field was checked on the way in
        raise CaptureError(f"{r.where}: the captured profile does not validate: {problem}")
    return Capture(text, plain(doc.data()), tuple(left_out), addresses)



def _problem(text: str) -> str | None:
    try:
        load_profile_text(text, "<capture>")
    except ProfileError as exc:
        return str(exc).splitlines()[0]
    return None



def _wrap(note: str, width: int = 86) -> list[str]:
    words = note.split(" ")
    lines: list[str] = []
    current = "  -"
    for w in words:
        if len(current) + 1 + len(w) > width and current.strip() not in ("-", ""):
            lines.append(current)
            current = "   "
        current += " " + w
    lines.append(current)
    return lines
