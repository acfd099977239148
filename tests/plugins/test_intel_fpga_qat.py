"""Intel's FPGA and QAT device plugins, UNMODIFIED, against our tree and the kubelet harness.

Both come from the same released Go module as the GPU plugin
(github.com/intel/intel-device-plugins-for-kubernetes v0.36.0, cmd/fpga_plugin and
cmd/qat_plugin), built by scripts/build-plugins into the cache. Each hard-codes /sys, /dev
and /var/lib/kubelet/device-plugins, so it runs in a private mount namespace with the live
FUSE tree and the harness directory bound over those paths (tests/support/thirdparty.py).

What they read (v0.36.0 source):

- FPGA plugin, DFL flavour (no /sys/class/fpga, so not OPAE): every
  ``/sys/class/fpga_region/regionN`` holding ``dfl-port.M`` entries; for each port,
  ``/dev/dfl-port.M`` is stat()ed for its major:minor, ``/sys/dev/char/MAJ:MIN`` resolved
  to the port's sysfs directory (``afu_id``, ``id``), the PCI function above it must have
  class 0x120000; the FME is ``<pci>/fpga_region/region*/dfl-fme.*`` (its ``dev`` through
  ``/dev/char/MAJ:MIN`` to ``/dev/dfl-fme.N``) and its interface id the nested PR region's
  ``compat_id``. ``-mode region`` offers ``fpga.intel.com/region-<compat_id>`` per FME
  (Allocate: the region's port nodes, a CDI device, the mode annotation; ``regiondevel``
  adds the FME's node instead of the CDI device and annotation); ``-mode af``
  offers ``fpga.intel.com/af-<3 hex>.<3 hex>.<base64url(interface id + afu id)>`` per
  port (Allocate: that port's node). No ioctl is made while scanning.
- QAT plugin, ``-dpdk-driver vfio-pci`` (its default): PFs under
  ``/sys/bus/pci/drivers/{4xxx,420xx}``, their ``virtfn*``; with no such PF (a guest with
  passed-through VFs: profiles/qat-vfio.yaml) every ``/sys/bus/pci/devices/*`` whose
  ``device`` is a QAT VF id (0x4941: 4xxx). A VF must be bound to vfio-pci (else it
  writes the drivers' unbind/bind files); its ``iommu_group`` link names ``/dev/vfio/N``.
  Without a ``physfn`` there is no PF ``qat/cfg_services`` to read, so the resource is
  ``qat.intel.com/generic``; Allocate answers ``/dev/vfio/N``, ``/dev/vfio/vfio`` and the
  VF's address in ``QAT0``.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandbox.kubelet import DeviceManager
from sandbox.kubelet.resources import Snapshot
from tests.support.thirdparty import (
    KUBELET_PLUGIN_DIR,
    Bind,
    LiveNode,
    Tmpfs,
    in_private_mounts,
    live_node,
    plugin_binary,
    require_private_mounts,
    running_plugin,
    short_dir,
)

pytestmark = [pytest.mark.root, pytest.mark.fuse, pytest.mark.network]

FPGA_NS = "fpga.intel.com"
QAT_GENERIC = "qat.intel.com/generic"


@dataclass(frozen=True)
class Running:
    live: LiveNode
    dm: DeviceManager
    log: Path

    def wait(self, what: str, predicate: object, timeout: float = 30) -> Snapshot:
        assert callable(predicate)
        try:
            return self.dm.wait_for(predicate, timeout, what)
        except Exception:
            print(self.log.read_text(errors="replace")[-4000:])
            raise


@contextlib.contextmanager
def intel_plugin(name: str, args: list[str], profile: str, node: str) -> Iterator[Running]:
    """``name`` (scripts/build-plugins) run with ``args`` on ``profile``'s live ``node``,
    registering with a DeviceManager; /sys and /dev are the node's, /run a private tmpfs
    (the FPGA plugin writes CDI specs to /var/run/cdi)."""
    binary = plugin_binary(name)
    require_private_mounts()
    with live_node(profile, node) as live, short_dir("kf-") as base:
        with DeviceManager(base / "dp") as dm:
            cmd = in_private_mounts(
                [str(binary), "-v", "3", *args],
                [Tmpfs("/var/lib"), Bind(str(dm.directory), KUBELET_PLUGIN_DIR), Tmpfs("/run"),
                 Bind(str(live.root / "sys"), "/sys"), Bind(str(live.root / "dev"), "/dev")],
                unset_env=["NODE_NAME"],  # no cluster to read a mode annotation from
            )  # fmt: skip
            log = base / "plugin.log"
            with running_plugin(cmd, log):
                yield Running(live, dm, log)


# FPGA ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Port:
    name: str  # dfl-port.N
    afu_id: str
    fme: str  # dfl-fme.N of the same card
    interface_id: str  # the FME's PR region compat_id


def dfl_ports(root: Path) -> dict[str, Port]:
    """The tree's DFL ports as the plugin should see them, read with plain file reads."""
    out = {}
    for region in sorted((root / "sys/class/fpga_region").iterdir()):
        ports = sorted(region.glob("dfl-port.*"))
        if not ports:
            continue  # an FME's nested PR region
        (fme,) = region.glob("dfl-fme.*")
        (compat,) = fme.glob("dfl-fme-region.*/fpga_region/region*/compat_id")
        for p in ports:
            out[p.name] = Port(p.name, (p / "afu_id").read_text().strip(), fme.name,
                               compat.read_text().strip())  # fmt: skip
    return out


def af_resource(interface_id: str, afu_id: str) -> str:
    """pkg/fpga.GetAfuDevType, restated: af-<if[:3]>.<afu[:3]>.<base64url, no padding>."""
    b64 = base64.urlsafe_b64encode(bytes.fromhex(interface_id + afu_id)).rstrip(b"=").decode()
    return f"{FPGA_NS}/af-{interface_id[:3]}.{afu_id[:3]}.{b64}"


def test_fpga_dfl_tree_has_what_the_plugin_resolves() -> None:
    """The links the plugin follows resolve in a rendered tree: /dev/char/MAJ:MIN of every
    port and FME names its /dev node, and /sys/dev/char/MAJ:MIN its sysfs directory."""
    with live_node("fpga-dfl.yaml", "fpga-worker") as live:
        root = live.root
        ports = dfl_ports(root)
        assert sorted(ports) == ["dfl-port.0", "dfl-port.1"]
        for port in ports.values():
            for name in (port.name, port.fme):
                sysdir = next((root / "sys/class/fpga_region").glob(f"region*/{name}"))
                dev = (sysdir / "dev").read_text().strip()
                assert (root / "dev/char" / dev).resolve() == root / "dev" / name
                assert (root / "sys/dev/char" / dev).resolve() == sysdir.resolve()
                pci = sysdir.resolve().parent.parent.parent
                assert (pci / "class").read_text() == "0x120000\n"


def test_intel_fpga_plugin_region_mode() -> None:
    """One fpga.intel.com/region-<interface id> per FME; Allocate names the card's port."""
    with intel_plugin("intel-fpga-plugin", ["-mode", "region"], "fpga-dfl.yaml",
                      "fpga-worker") as run:  # fmt: skip
        ports = dfl_ports(run.live.root)
        interface_ids = {p.interface_id for p in ports.values()}
        assert len(interface_ids) == 1  # both cards carry the same FIM bitstream
        (iface,) = interface_ids
        resource = f"{FPGA_NS}/region-{iface}"
        snap = run.wait(f"2 {resource}", lambda s: s.capacity(resource) == 2)
        state = snap.resources[resource]
        assert state.allocatable == 2
        assert {d.id for d in state.devices} == {p.fme for p in ports.values()}

        alloc = run.dm.allocate(resource, 1)
        (fme,) = alloc.device_ids
        want = sorted(f"/dev/{p.name}" for p in ports.values() if p.fme == fme)
        assert sorted(c for c, _, _ in alloc.devices) == want
        assert all(c == h and perm == "rw" for c, h, perm in alloc.devices)
        assert alloc.annotations == {"com.intel.fpga.mode": "fpga.intel.com/region"}
        assert alloc.cdi_devices == (f"intel.cdi.k8s.io/fpga={fme}",)


def test_intel_fpga_plugin_regiondevel_mode() -> None:
    """Development mode: the same region resource, Allocate adds the FME's /dev/dfl-fme.N
    (for reprogramming from the container); no CDI device, no annotation."""
    with intel_plugin("intel-fpga-plugin", ["-mode", "regiondevel"], "fpga-dfl.yaml",
                      "fpga-worker") as run:  # fmt: skip
        ports = dfl_ports(run.live.root)
        (iface,) = {p.interface_id for p in ports.values()}
        resource = f"{FPGA_NS}/region-{iface}"
        run.wait(f"2 {resource}", lambda s: s.capacity(resource) == 2)
        alloc = run.dm.allocate(resource, 1)
        (fme,) = alloc.device_ids
        want = sorted([f"/dev/{fme}", *(f"/dev/{p.name}" for p in ports.values() if p.fme == fme)])
        assert sorted(c for c, _, _ in alloc.devices) == want
        assert (alloc.annotations, alloc.cdi_devices) == ({}, ())


def test_intel_fpga_plugin_af_mode() -> None:
    """One fpga.intel.com/af-... per port with that AFU; Allocate names /dev/dfl-port.N."""
    with intel_plugin("intel-fpga-plugin", ["-mode", "af"], "fpga-dfl.yaml",
                      "fpga-worker") as run:  # fmt: skip
        ports = dfl_ports(run.live.root)
        resources = {af_resource(p.interface_id, p.afu_id) for p in ports.values()}
        assert len(resources) == 1  # the profile loads one AFU into both ports
        (resource,) = resources
        snap = run.wait(f"2 {resource}", lambda s: s.capacity(resource) == 2)
        assert {d.id for d in snap.resources[resource].devices} == set(ports)

        first = run.dm.allocate(resource, 1)
        second = run.dm.allocate(resource, 1)
        for alloc in (first, second):
            (port,) = alloc.device_ids
            assert alloc.devices == ((f"/dev/{port}", f"/dev/{port}", "rw"),)
            assert alloc.annotations == {}
        assert {*first.device_ids, *second.device_ids} == set(ports)


# QAT ---------------------------------------------------------------------------------------


def qat_vfs(root: Path) -> dict[str, str]:
    """BDF -> IOMMU group of every QAT 4xxx VF (8086:4941) bound to vfio-pci."""
    out = {}
    for dev in sorted((root / "sys/bus/pci/devices").iterdir()):
        if (dev / "device").read_text().strip() != "0x4941":
            continue
        assert (dev / "driver").resolve().name == "vfio-pci"
        out[dev.name] = (dev / "iommu_group").resolve().name
    return out


def test_intel_qat_plugin_on_vfio_vfs() -> None:
    """Every VF becomes one qat.intel.com/generic; Allocate names its /dev/vfio/<group>
    node (which the tree has) and the container's /dev/vfio/vfio."""
    with intel_plugin("intel-qat-plugin", ["-dpdk-driver", "vfio-pci"], "qat-vfio.yaml",
                      "qat-worker") as run:  # fmt: skip
        root = run.live.root
        vfs = qat_vfs(root)
        assert len(vfs) == 4
        snap = run.wait(f"4 {QAT_GENERIC}", lambda s: s.capacity(QAT_GENERIC) == 4)
        state = snap.resources[QAT_GENERIC]
        assert state.allocatable == 4
        assert {d.id for d in state.devices} == set(vfs)

        alloc = run.dm.allocate(QAT_GENERIC, 2)
        assert len(alloc.device_ids) == 2
        want = {"/dev/vfio/vfio", *(f"/dev/vfio/{vfs[b]}" for b in alloc.device_ids)}
        assert {c for c, _, _ in alloc.devices} == want
        assert all(c == h and perm == "rw" for c, h, perm in alloc.devices)
        for container_path, _, _ in alloc.devices:
            assert (root / container_path.lstrip("/")).is_char_device(), container_path
        assert sorted(alloc.envs.values()) == sorted(alloc.device_ids)
        assert sorted(alloc.envs) == ["QAT0", "QAT1"]
