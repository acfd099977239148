"""The node-wide kernel interfaces of the fake tree, read back by real programs where one
exists (lscpu, lstopo, lsmem, lspci) and otherwise checked against the formats of the
kernel's Documentation/ABI: caches per CPU model, root ports per CPU vendor, memory blocks,
bus links, /proc/swaps, DMI, cpufreq/cpuidle, IOMMU units and the loopback interface."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from sandbox.errors import ProfileError
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.builder._system import block_size
from sandbox.fakehw.render import render
from sandbox.profile import load_profile_text
from sandbox.profile.spec import NodeSpec
from tests.support.readers import lscpu, lspci_records, lstopo, need, run

pytestmark = [pytest.mark.root]

MiB, GiB = 2**20, 2**30
PACKAGES = {"free": "procps", "cpupower": "linux-cpupower"}

AMD_CPU = ("cpu: {sockets: 2, coresPerSocket: 24, threadsPerCore: 2, vendor: AuthenticAMD, "
           "model: AMD EPYC 9454 48-Core Processor, family: 25, modelNumber: 17}")
INTEL_CPU = "cpu: {sockets: 2, coresPerSocket: 16, threadsPerCore: 2}"


def profile(node: str, name: str = "n") -> str:
    return (
        "apiVersion: hwsandbox.dev/v1alpha1\nkind: HardwareProfile\n"
        f"metadata: {{name: t}}\nnodes:\n  - name: {name}\n"
        + "".join(f"    {line}\n" for line in node.strip().splitlines())
    )


def node_of(text: str) -> NodeSpec:
    return load_profile_text(profile(text)).cluster.nodes[0]


_rendered: dict[str, tuple[NodeSpec, Path]] = {}


def rendered(tmp_path_factory: pytest.TempPathFactory, text: str) -> tuple[NodeSpec, Path]:
    if text not in _rendered:
        node = node_of(text)
        root = tmp_path_factory.mktemp("root")
        render(build_tree(node), root, force=True)
        _rendered[text] = (node, root)
    return _rendered[text]


AMD_NODE = f"{AMD_CPU}\nmemory: 256Gi\ndevices:\n  - {{type: gpu, vendor: amd, model: mi300x}}"
INTEL_NODE = f"{INTEL_CPU}\nmemory: 32Gi\ndevices:\n  - {{type: gpu, vendor: nvidia, model: t4}}"


@pytest.fixture
def amd(tmp_path_factory: pytest.TempPathFactory) -> tuple[NodeSpec, Path]:
    return rendered(tmp_path_factory, AMD_NODE)


@pytest.fixture
def intel(tmp_path_factory: pytest.TempPathFactory) -> tuple[NodeSpec, Path]:
    return rendered(tmp_path_factory, INTEL_NODE)


# -- caches and root ports ---------------------------------------------------------------
def test_lscpu_sees_zen4_caches_l3_per_ccx(amd: tuple[NodeSpec, Path]) -> None:
    _, root = amd
    info = lscpu(root)
    assert info["L1d cache"] == "1.5 MiB (48 instances)"  # 32K x 24 cores x 2 sockets
    assert info["L1i cache"] == "1.5 MiB (48 instances)"
    assert info["L2 cache"] == "48 MiB (48 instances)"  # 1M per core
    assert info["L3 cache"] == "192 MiB (6 instances)"  # 32M per CCX of 8 cores, 3 per socket
    l3 = root / "sys/devices/system/cpu/cpu0/cache/index3"
    assert (l3 / "shared_cpu_list").read_text() == "0-7,48-55\n"
    assert (l3 / "size").read_text() == "32768K\n"
    ids = {(root / f"sys/devices/system/cpu/cpu{c}/cache/index3/id").read_text()
           for c in (0, 8, 16, 24, 40)}
    assert ids == {"0\n", "1\n", "2\n", "3\n", "5\n"}
    assert "cache size\t: 1024 KB\n" in (root / "proc/cpuinfo").read_text()  # AMD: the L2


def test_lscpu_sees_sapphire_rapids_caches_l3_per_socket(intel: tuple[NodeSpec, Path]) -> None:
    _, root = intel
    info = lscpu(root)
    assert info["L1d cache"] == "1.5 MiB (32 instances)"  # 48K per core
    assert info["L2 cache"] == "64 MiB (32 instances)"  # 2M per core
    assert info["L3 cache"] == "60 MiB (2 instances)"  # 1920K x 16 cores per socket
    assert "cache size\t: 30720 KB\n" in (root / "proc/cpuinfo").read_text()


@pytest.mark.parametrize(("which", "vendor", "device"), [("amd", "1022", "14ab"),
                                                    ("intel", "8086", "352a")])
def test_root_ports_have_the_cpu_vendors_ids(which: str, vendor: str, device: str,
                                             request: pytest.FixtureRequest) -> None:
    node, root = request.getfixturevalue(which)
    records = lspci_records(root)
    ports = [f.address for f in node.bridges if f.port_type == 4]
    assert ports
    for addr in ports:
        assert records[addr]["Vendor"].endswith(f"[{vendor}]")
        assert records[addr]["Device"].endswith(f"[{device}]")


def test_unknown_vendor_falls_back_to_intel_layout() -> None:
    node = node_of("cpu: {sockets: 1, coresPerSocket: 4, vendor: HygonGenuine}\nmemory: 8Gi")
    tree = build_tree(node)
    entry = tree.get("sys/devices/system/cpu/cpu0/cache/index0/size")
    assert entry is not None
    assert getattr(entry, "data", b"") == b"48K\n"


# -- memory blocks and bus links ---------------------------------------------------------
def lsmem(root: Path) -> dict[str, object]:
    data = json.loads(run([need_lsmem(), "--sysroot", str(root), "-J", "-b", "-a",
                           "-o", "RANGE,SIZE,STATE,REMOVABLE,BLOCK,NODE,ZONES"]))
    return dict(data)


def need_lsmem() -> str:
    path = shutil.which("lsmem")
    if path is None:
        pytest.fail("lsmem is not installed: apt-get install -y util-linux")
    return path


@pytest.mark.parametrize(("which", "block"), [("amd", 2 * GiB), ("intel", 128 * MiB)])
def test_lsmem_sees_every_block_on_its_numa_node(which: str, block: int,
                                                 request: pytest.FixtureRequest) -> None:
    node, root = request.getfixturevalue(which)
    mem = root / "sys/devices/system/memory"
    assert (mem / "block_size_bytes").read_text() == f"{block:x}\n"
    rows = lsmem(root)["memory"]
    assert isinstance(rows, list)
    expected: list[tuple[int, int]] = []
    for n in node.numa:
        expected += [(len(expected) + k, n.id) for k in range(-(-n.memory // block))]
    assert [(int(r["block"]), int(r["node"])) for r in rows] == expected
    for r in rows:
        start = int(r["block"]) * block
        assert r["range"] == f"0x{start:016x}-0x{start + block - 1:016x}"
        assert int(r["size"]) == block
        assert r["state"] == "online"
        assert r["removable"] is True
        zone = "None" if start == 0 else ("DMA32" if start < 4 * GiB else "Normal")
        assert r["zones"] == zone
    # Each node's blocks are linked from the node, and the node's meminfo agrees.
    for n in node.numa:
        blocks = sorted(int(p.name[6:]) for p in
                        (root / f"sys/devices/system/node/node{n.id}").glob("memory*"))
        assert blocks == [b for b, k in expected if k == n.id]
        assert len(blocks) * block >= n.memory > (len(blocks) - 1) * block
    block0 = mem / "memory0"
    assert (block0 / "phys_index").read_text() == "00000000\n"
    assert (block0 / "phys_device").read_text() == "0\n"
    assert os.readlink(block0 / "subsystem") == "../../../../bus/memory"
    assert os.readlink(root / "sys/bus/memory/devices/memory0") == \
        "../../../devices/system/memory/memory0"


def test_bus_links_are_the_kernels(amd: tuple[NodeSpec, Path]) -> None:
    node, root = amd
    cpus = sorted((root / "sys/bus/cpu/devices").iterdir(), key=lambda p: int(p.name[3:]))
    assert [p.name for p in cpus] == [f"cpu{c.id}" for c in sorted(node.cpus, key=lambda c: c.id)]
    assert os.readlink(cpus[0]) == "../../../devices/system/cpu/cpu0"
    assert cpus[0].resolve() == (root / "sys/devices/system/cpu/cpu0").resolve()
    nodes = sorted(p.name for p in (root / "sys/bus/node/devices").iterdir())
    assert nodes == [f"node{n.id}" for n in node.numa]
    assert os.readlink(root / "sys/bus/node/devices/node0") == "../../../devices/system/node/node0"
    assert os.readlink(root / "sys/devices/system/cpu/cpu0/subsystem") == "../../../../bus/cpu"
    assert os.readlink(root / "sys/devices/system/node/node0/subsystem") == \
        "../../../../bus/node"


def test_block_size_as_x86_64_picks_it() -> None:
    assert block_size(16 * GiB) == 128 * MiB
    assert block_size(64 * GiB - 1) == 128 * MiB
    assert block_size(64 * GiB) == 2 * GiB
    assert block_size(1536 * GiB) == 2 * GiB
    assert block_size(64 * 2**40) == 8 * GiB  # past 8192 blocks: a sandbox limit


# -- swap --------------------------------------------------------------------------------
HEADER = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"  # mm/swapfile.c swap_show


def test_proc_swaps_without_swap_is_the_header(intel: tuple[NodeSpec, Path]) -> None:
    _, root = intel
    assert (root / "proc/swaps").read_text() == HEADER
    meminfo = (root / "proc/meminfo").read_text()
    assert "SwapTotal:             0 kB\n" in meminfo
    assert "SwapFree:              0 kB\n" in meminfo


def test_swap_from_the_profile_in_proc_swaps_meminfo_and_free(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    node, root = rendered(tmp_path_factory, f"{INTEL_CPU}\nmemory: 32Gi\nswap: 8Gi")
    assert node.swap == 8 * GiB
    kb = 8 * 2**20 - 4  # the header page is not swap space
    swaps = (root / "proc/swaps").read_text()
    assert swaps == HEADER + f"/swap.img{' ' * 31}file\t\t{kb}\t\t0\t\t-2\n"
    meminfo = (root / "proc/meminfo").read_text()
    assert f"SwapTotal:       {kb} kB\n" in meminfo
    assert f"SwapFree:        {kb} kB\n" in meminfo
    # procps' free reads /proc/meminfo: run it over the fake one in a mount namespace.
    out = in_namespace(root, ["proc/meminfo"], ["free", "-k"])
    swap_line = next(line for line in out.splitlines() if line.startswith("Swap:"))
    assert swap_line.split()[1:4] == [str(kb), "0", str(kb)]


def in_namespace(root: Path, paths: list[str], argv: list[str]) -> str:
    """``argv`` with the fake ``paths`` bind-mounted over the real ones in a private mount
    namespace (the real /proc and /sys are never written)."""
    if os.geteuid() != 0:
        pytest.fail("reading fake /proc or /sys entries needs root (unshare -m and bind mounts)")
    tool = shutil.which(argv[0])
    if tool is None:
        pytest.fail(f"{argv[0]} is not installed: apt-get install -y {PACKAGES[argv[0]]}")
    binds = " && ".join(f"mount --bind '{root / p}' '/{p}'" for p in paths)
    script = f"{binds} && exec {' '.join([tool, *argv[1:]])}"
    return run([need("unshare"), "-m", "--propagation", "private", "sh", "-c", script])


def test_swap_below_ten_pages_is_refused_where_it_is_written() -> None:
    with pytest.raises(ProfileError) as err:
        load_profile_text(profile(f"{INTEL_CPU}\nswap: 4Ki"), "p.yaml")
    assert "nodes[0].swap" in str(err.value)
    assert "10 pages" in str(err.value)
    with pytest.raises(ProfileError) as err:
        load_profile_text(profile(f"{INTEL_CPU}\nswap: lots"), "p.yaml")
    assert "nodes[0].swap" in str(err.value)


# -- DMI ---------------------------------------------------------------------------------
def dmi_info(root: Path) -> dict[str, str]:
    xml = lstopo(root)
    machine = next(o for o in xml.iter("object") if o.get("type") == "Machine")
    return {str(i.get("name")): str(i.get("value")) for i in machine.iter("info")
            if str(i.get("name")).startswith("DMI")}


def test_lstopo_reads_the_default_dmi_identity_per_cpu_vendor(
        amd: tuple[NodeSpec, Path], intel: tuple[NodeSpec, Path]) -> None:
    for (node, root), product in ((amd, "AS -2025HS-TNR"), (intel, "SYS-221H-TNR")):
        info = dmi_info(root)
        assert info["DMISysVendor"] == "Supermicro"
        assert info["DMIProductName"] == product
        assert info["DMIChassisType"] == "17"
        assert node.system is not None
        assert info["DMIProductUUID"] == node.system.product_uuid
        assert info["DMIBIOSVendor"] == "American Megatrends International, LLC."
        dmi = root / "sys/devices/virtual/dmi/id"
        for name in ("product_uuid", "product_serial", "board_serial", "chassis_serial"):
            assert (dmi / name).stat().st_mode & 0o777 == 0o400, name  # root only
        assert (dmi / "sys_vendor").stat().st_mode & 0o777 == 0o444
        assert os.readlink(root / "sys/class/dmi/id") == "../../devices/virtual/dmi/id"


def test_dmi_from_the_profile_and_its_modalias(tmp_path_factory: pytest.TempPathFactory
                                              ) -> None:
    system = ("system: {vendor: Dell Inc., product: PowerEdge XE9680, chassisType: 23,\n"
              "         board: {name: 0NHVD9, version: A01},\n"
              "         bios: {vendor: Dell Inc., version: 2.3.5, date: 08/09/2024}}")
    node, root = rendered(tmp_path_factory, f"{INTEL_CPU}\nmemory: 32Gi\n{system}")
    info = dmi_info(root)
    assert info["DMISysVendor"] == "Dell Inc."
    assert info["DMIProductName"] == "PowerEdge XE9680"
    assert info["DMIBoardVendor"] == "Dell Inc."  # defaults to the system vendor
    assert info["DMIBoardName"] == "0NHVD9"
    assert info["DMIBIOSVersion"] == "2.3.5"
    assert info["DMIBIOSDate"] == "08/09/2024"
    assert info["DMIChassisType"] == "23"
    dmi = root / "sys/devices/virtual/dmi/id"
    # drivers/firmware/dmi-id.c: spaces and colons dropped, one field after another.
    assert (dmi / "modalias").read_text() == (
        "dmi:bvnDellInc.:bvr2.3.5:bd08/09/2024:br2.3:svnDellInc.:pnPowerEdgeXE9680:"
        "pvr0123456789:rvnDellInc.:rn0NHVD9:rvrA01:cvnDellInc.:ct23:cvr0123456789:"
        "skuTobefilledbyO.E.M.:\n")
    # Replicas share the model, not the identity.
    two = load_profile_text(profile(f"{INTEL_CPU}\ncount: 2")).cluster.nodes
    assert two[0].system is not None
    assert two[1].system is not None
    assert two[0].system.product_uuid != two[1].system.product_uuid
    assert two[0].system.product_name == two[1].system.product_name


def test_a_bad_bios_date_is_refused_where_it_is_written() -> None:
    with pytest.raises(ProfileError) as err:
        load_profile_text(profile(f"{INTEL_CPU}\nsystem: {{bios: {{date: 2024-08-09}}}}"),
                          "p.yaml")
    assert "nodes[0].system.bios.date" in str(err.value)


# -- cpufreq and cpuidle -----------------------------------------------------------------
@pytest.mark.parametrize(("which", "driver", "pstate", "idle"), [
    ("amd", "amd-pstate-epp", "amd_pstate", "acpi_idle"),
    ("intel", "intel_pstate", "intel_pstate", "intel_idle")])
def test_cpufreq_and_cpuidle_per_cpu_vendor(which: str, driver: str, pstate: str, idle: str,
                                            request: pytest.FixtureRequest) -> None:
    node, root = request.getfixturevalue(which)
    cpu = root / "sys/devices/system/cpu"
    top = int((cpu / "cpu0/cpufreq/cpuinfo_max_freq").read_text())
    low = int((cpu / "cpu0/cpufreq/cpuinfo_min_freq").read_text())
    info = lscpu(root)  # lscpu reads cpuN/cpufreq/cpuinfo_{max,min}_freq
    assert info["CPU max MHz"] == f"{top / 1000:.4f}"
    assert info["CPU min MHz"] == f"{low / 1000:.4f}"
    assert low <= node.cpu.mhz * 1000 < top
    for c in node.cpus:
        policy = cpu / f"cpu{c.id}/cpufreq"
        assert os.readlink(policy) == f"../cpufreq/policy{c.id}"
        assert (policy / "scaling_driver").read_text() == f"{driver}\n"
        assert (policy / "affected_cpus").read_text() == f"{c.id}\n"
    policy0 = cpu / "cpufreq/policy0"
    governors = (policy0 / "scaling_available_governors").read_text().split()
    assert (policy0 / "scaling_governor").read_text().strip() in governors
    assert (cpu / f"{pstate}/status").read_text() == "active\n"
    # ABI/testing/sysfs-devices-system-cpu: cpuidle/current_driver, stateN/{name,desc,...}
    assert (cpu / "cpuidle/current_driver").read_text() == f"{idle}\n"
    states = sorted(p.name for p in (cpu / "cpu0/cpuidle").iterdir())
    assert states[0] == "state0"
    assert (cpu / "cpu0/cpuidle/state0/name").read_text() == "POLL\n"
    previous = -1
    for s in states:
        d = cpu / f"cpu0/cpuidle/{s}"
        for attr in ("name", "desc", "latency", "residency", "usage", "time", "disable",
                     "rejected", "above", "below", "default_status", "power"):
            assert (d / attr).read_text().endswith("\n"), attr
        latency = int((d / "latency").read_text())
        assert latency > previous  # deeper states take longer to leave
        previous = latency
        assert int((d / "residency").read_text()) >= latency


@pytest.mark.parametrize("which", ["amd", "intel"])
def test_idle_module_parameters_follow_the_cpuidle_driver(which: str,
                                                          request: pytest.FixtureRequest) -> None:
    """intel_idle's parameters exist where it is the driver (tools read max_cstate there);
    the ACPI processor module's always, with the kernel's modes."""
    _, root = request.getfixturevalue(which)
    module = root / "sys/module"
    driver = (root / "sys/devices/system/cpu/cpuidle/current_driver").read_text().strip()
    assert (module / "intel_idle").exists() == (driver == "intel_idle")
    if driver == "intel_idle":
        params = module / "intel_idle/parameters"
        assert (params / "max_cstate").read_text() == "9\n"
        assert sorted(p.name for p in params.iterdir()) == [
            "force_irq_on", "ibrs_off", "max_cstate", "no_acpi", "no_native",
            "preferred_cstates", "states_off", "use_acpi"]
        assert {p.stat().st_mode & 0o777 for p in params.iterdir()} == {0o444}
    processor = module / "processor/parameters"
    assert (processor / "max_cstate").read_text() == "8\n"
    assert (processor / "max_cstate").stat().st_mode & 0o777 == 0o400
    assert (processor / "latency_factor").stat().st_mode & 0o777 == 0o644


def test_block_directories_exist_without_a_drive(intel: tuple[NodeSpec, Path]) -> None:
    node, root = intel
    assert not any(d.nvme is not None for d in node.devices)
    for d in ("sys/block", "sys/class/block", "sys/dev/block"):
        assert (root / d).is_dir(), d
        assert not any((root / d).iterdir()), d


@pytest.mark.parametrize(("which", "driver", "idle"), [
    ("amd", "amd-pstate-epp", "acpi_idle"), ("intel", "intel_pstate", "intel_idle")])
def test_cpupower_reads_cpufreq_and_cpuidle(which: str, driver: str, idle: str,
                                            request: pytest.FixtureRequest) -> None:
    """Linux's own cpupower (tools/power/cpupower) over the fake cpu directory."""
    node, root = request.getfixturevalue(which)
    cpu = root / "sys/devices/system/cpu"
    last = max(c.id for c in node.cpus)
    top = (cpu / "cpu0/cpufreq/cpuinfo_max_freq").read_text().strip()
    low = (cpu / "cpu0/cpufreq/cpuinfo_min_freq").read_text().strip()

    def cpupower(*args: str) -> str:
        return in_namespace(root, ["sys/devices/system/cpu"], ["cpupower", *args])

    assert cpupower("-c", "0", "frequency-info", "-l").splitlines()[1] == f"{low} {top}"
    assert f"driver: {driver}\n" in cpupower("-c", str(last), "frequency-info", "-d")
    assert "governors: performance powersave" in cpupower("-c", "0", "frequency-info", "-g")
    out = cpupower("-c", str(last), "idle-info")
    assert f"CPUidle driver: {idle}\n" in out
    assert "CPUidle governor: menu\n" in out
    names = [(cpu / f"cpu0/cpuidle/state{k}/name").read_text().strip()
             for k in range(len(list((cpu / "cpu0/cpuidle").iterdir())))]
    assert f"Number of idle states: {len(names)}\n" in out
    assert f"Available idle states: {' '.join(names)}\n" in out
    for k, name in enumerate(names):
        latency = (cpu / f"cpu0/cpuidle/state{k}/latency").read_text().strip()
        assert f"{name}:\nFlags/Description: " in out
        assert f"Latency: {latency}\n" in out


# -- IOMMU units and lo ------------------------------------------------------------------
@pytest.mark.parametrize(("which", "prefix", "sub", "attrs"), [
    ("amd", "ivhd", "amd-iommu", {"cap", "features"}),
    ("intel", "dmar", "intel-iommu",
     {"address", "cap", "ecap", "version", "domains_supported", "domains_used"})])
def test_iommu_units_per_cpu_vendor(which: str, prefix: str, sub: str, attrs: set[str],
                                    request: pytest.FixtureRequest) -> None:
    node, root = request.getfixturevalue(which)
    units = sorted(p.name for p in (root / "sys/class/iommu").iterdir())
    assert units == [f"{prefix}{k}" for k in range(len(node.host_bridges))]
    unit = root / "sys/class/iommu" / units[0]
    assert {p.name for p in (unit / sub).iterdir()} == attrs
    for attr in attrs:  # ABI: hexadecimal registers, decimal counts, "1:0" version
        value = (unit / sub / attr).read_text()
        assert re.fullmatch(r"[0-9a-f]+\n|[0-9]+:[0-9]+\n", value), (attr, value)


def test_loopback_interface(intel: tuple[NodeSpec, Path]) -> None:
    _, root = intel
    lo = root / "sys/class/net/lo"
    assert os.readlink(lo) == "../../devices/virtual/net/lo"
    assert (lo / "ifindex").read_text() == "1\n"
    assert (lo / "operstate").read_text() == "unknown\n"
    assert (lo / "type").read_text() == "772\n"  # ARPHRD_LOOPBACK
    assert int((lo / "flags").read_text(), 16) == 0x9  # IFF_UP | IFF_LOOPBACK
    assert (lo / "mtu").read_text() == "65536\n"
    assert (lo / "address").read_text() == "00:00:00:00:00:00\n"
