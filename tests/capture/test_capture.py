"""``sandbox capture``: a machine's /sys and /proc as a profile, proven by round trips.

Two round trips (issue 14 item 2):

* this machine: capture ``/``, render the profile, and compare the covered files with the
  real /sys (``test_host_round_trip``);
* our own 2-socket GPU server: render ``profiles/8gpu-2numa.yaml``, capture the directory,
  render the captured profile, and compare the two trees byte for byte
  (``test_render_capture_render_is_identical``).
"""

from __future__ import annotations

import collections
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sandbox.capture import Capture, CaptureError, capture, write_capture
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.outfile import OutputError
from sandbox.profile import load_profile, load_profile_text
from sandbox.profile.cpulist import parse_cpulist
from tests.support.paths import REPO

pytestmark = [pytest.mark.root]

PROFILES = REPO / "profiles"
DEMO = PROFILES / "8gpu-2numa.yaml"
CPU = "sys/devices/system/cpu"
NODE = "sys/devices/system/node"
PCI = "sys/bus/pci/devices"
TOPOLOGY = ("core_id", "physical_package_id", "thread_siblings_list", "core_siblings_list",
            "package_cpus_list")


def _read(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text().strip()
    except OSError:
        return None


def _names(root: Path, rel: str, prefix: str) -> set[str]:
    try:
        return {n for n in os.listdir(root / rel)
                if n.startswith(prefix) and n[len(prefix):].isdigit()}
    except OSError:
        return set()


def _functions(root: Path) -> dict[str, dict[str, str | None]]:
    """Every PCI function below root that is not a PCI-to-PCI bridge (host bridges are
    compared): its compared attributes."""
    out: dict[str, dict[str, str | None]] = {}
    for address in sorted(os.listdir(root / PCI)) if (root / PCI).is_dir() else []:
        base = f"{PCI}/{address}"
        cls = _read(root, f"{base}/class") or ""
        if cls.startswith("0x06") and not cls.startswith(("0x0680", "0x0600")):
            continue  # bridges: the resolver plans its own (see the test's docstring)
        out[address] = {
            "vendor": _read(root, f"{base}/vendor"),
            "device": _read(root, f"{base}/device"),
            "class": cls,
            "numa_node": _read(root, f"{base}/numa_node"),
            "local_cpulist": _read(root, f"{base}/local_cpulist"),
            "vf": "yes" if os.path.lexists(root / base / "physfn") else "no",
        }
    return out


def compare_covered(real: Path, ours: Path, match_pci_by_address: bool) -> list[str]:
    """Every difference between two roots in the files the capture covers."""
    diffs: list[str] = []

    def same(rel: str) -> None:
        a, b = _read(real, rel), _read(ours, rel)
        if a != b:
            diffs.append(f"{rel}: real {a!r}, ours {b!r}")

    cpus_real, cpus_ours = _names(real, CPU, "cpu"), _names(ours, CPU, "cpu")
    if cpus_real != cpus_ours:
        diffs.append(f"{CPU}: cpuN real {sorted(cpus_real)}, ours {sorted(cpus_ours)}")
    same(f"{CPU}/online")
    same(f"{CPU}/present")
    for c in parse_cpulist(_read(real, f"{CPU}/online") or ""):
        for name in TOPOLOGY:
            if (real / CPU / f"cpu{c}" / "topology" / name).exists():
                same(f"{CPU}/cpu{c}/topology/{name}")
    nodes_real, nodes_ours = _names(real, NODE, "node"), _names(ours, NODE, "node")
    if nodes_real != nodes_ours:
        diffs.append(f"{NODE}: nodeN real {sorted(nodes_real)}, ours {sorted(nodes_ours)}")
    if nodes_real:
        same(f"{NODE}/online")
        same(f"{NODE}/has_cpu")
    for n in sorted(nodes_real & nodes_ours):
        same(f"{NODE}/{n}/cpulist")
    diffs += _compare_pci(_functions(real), _functions(ours), match_pci_by_address)
    return diffs


def _compare_pci(real: dict[str, dict[str, str | None]], ours: dict[str, dict[str, str | None]],
                 by_address: bool) -> list[str]:
    diffs: list[str] = []
    pfs_real = {a: v for a, v in real.items() if v["vf"] == "no"}
    pfs_ours = {a: v for a, v in ours.items() if v["vf"] == "no"}
    if by_address:
        for a in sorted(set(pfs_real) | set(pfs_ours)):
            if a not in pfs_ours:
                diffs.append(f"{PCI}/{a}: only on the machine ({pfs_real[a]})")
            elif a not in pfs_real:
                diffs.append(f"{PCI}/{a}: only in our tree ({pfs_ours[a]})")
            else:
                for key, value in pfs_real[a].items():
                    if pfs_ours[a][key] != value:
                        diffs.append(f"{PCI}/{a}/{key}: real {value!r}, ours "
                                     f"{pfs_ours[a][key]!r}")
    else:
        diffs += _multiset("PCI functions", pfs_real.values(), pfs_ours.values())
    # VFs: the resolver plans their addresses, so they are matched by what they are.
    diffs += _multiset("SR-IOV VFs", [v for v in real.values() if v["vf"] == "yes"],
                       [v for v in ours.values() if v["vf"] == "yes"])
    return diffs


def _multiset(what: str, real: object, ours: object) -> list[str]:
    def key(v: dict[str, str | None]) -> tuple[str | None, ...]:
        return tuple(v[k] for k in ("vendor", "device", "class", "numa_node", "local_cpulist"))

    a = collections.Counter(key(v) for v in real)  # type: ignore[attr-defined]
    b = collections.Counter(key(v) for v in ours)  # type: ignore[attr-defined]
    out = [f"{what}: {k} x{n} only on the machine" for k, n in sorted((a - b).items())]
    out += [f"{what}: {k} x{n} only in our tree" for k, n in sorted((b - a).items())]
    return out


def _render_captured(result: Capture, out: Path) -> None:
    node = load_profile_text(result.text, "<captured>").cluster.nodes[0]
    render(build_tree(node), out)


def snapshot(root: Path) -> dict[str, tuple[str, object]]:
    """Every entry below root: its kind and mode, and its link target or bytes."""
    out: dict[str, tuple[str, object]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", st.st_mode)
            elif os.access(p, os.R_OK):
                out[rel] = ("file", (st.st_mode, p.read_bytes()))
            else:  # write-only (`unbind`, 0200) as a user: its mode says all there is
                out[rel] = ("file", (st.st_mode, None))
    return out


def tree_differences(a: Path, b: Path) -> list[str]:
    sa, sb = snapshot(a), snapshot(b)
    out: list[str] = []
    for rel in sorted(set(sa) | set(sb)):
        if rel not in sb:
            out.append(f"{rel}: only in the first render")
        elif rel not in sa:
            out.append(f"{rel}: only in the second render")
        elif sa[rel] != sb[rel]:
            out.append(f"{rel}: {str(sa[rel])[:120]} != {str(sb[rel])[:120]}")
    return out


def test_host_round_trip(tmp_path: Path) -> None:
    """Capture this machine, render the profile, compare with the real /sys.

    Compared (the issue's covered subsystems): the cpuN directories, ``cpu/online``,
    ``cpu/present`` and each online CPU's ``topology/{core_id, physical_package_id,
    thread_siblings_list, core_siblings_list, package_cpus_list}``; the nodeN directories,
    ``node/online``, ``node/has_cpu`` and ``nodeN/cpulist``; every PCI function that is not
    a PCI-to-PCI bridge (the host bridge 0000:00:00.0 included) with its vendor, device,
    class, numa_node and local_cpulist, compared raw: no normalisation.

    Choices, where our tree cannot represent the machine:

    * bridges other than host bridges (class 06 but 0600 "host" and 0680 "other": root
      and switch ports, ISA bridges) are left out on both sides: the profile has no
      bridges, the resolver plans its own. The host bridge function 0000:00:00.0 is the
      machine's own (``pci.rootComplex``) and compared like a device;
    * a real ``numa_node`` of -1 (no firmware affinity, as on this VM) is captured as
      ``numaNode: none`` and rendered -1, with every CPU as ``local_cpulist``;
    * functions are matched by address: capture keeps the machine's addresses (or the
      resolver's plan already gives them). Only if the machine's addresses do not fit a
      profile (``pci_addresses == "planned"``) are they matched as a multiset of
      vendor:device:class:numa_node:local_cpulist, as SR-IOV VFs always are (the
      resolver plans VF addresses).
    """
    result = capture("/")
    out = tmp_path / "tree"
    _render_captured(result, out)
    diffs = compare_covered(Path("/"), out, result.pci_addresses == "machine")
    assert diffs == [], f"{len(diffs)} difference(s):\n" + "\n".join(diffs)


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The hand-made 2-socket GPU server: our render of 8gpu-2numa (read only)."""
    root = tmp_path_factory.mktemp("demo") / "root"
    render(build_tree(load_profile(DEMO).cluster.nodes[0]), root)
    return root


def test_render_capture_render_is_identical(demo_root: Path, tmp_path: Path) -> None:
    """A hand-made 2-socket GPU server (our render of 8gpu-2numa) captures back to an
    equivalent profile: rendering the capture gives the same tree, every file, link and
    mode. Serials, UUIDs and MACs are seeded by the profile and node names, so the capture
    is given those names."""
    loaded = load_profile(DEMO)
    result = capture(demo_root, name=loaded.cluster.name, node_name=loaded.profile.nodes[0].name)
    assert result.pci_addresses == "machine"
    captured = result.profile["nodes"][0]
    assert captured["cpu"]["sockets"] == 2
    assert len(captured["numa"]["nodes"]) == 2
    assert "pciAddresses" not in str(captured)  # the resolver's plan is the machine's
    written = [(d.type, d.count, d.numa_node) for d in loaded.profile.nodes[0].devices]
    assert [(d["type"], d.get("count", 1), d["numaNode"]) for d in captured["devices"]] == written
    second = tmp_path / "second"
    _render_captured(result, second)
    diffs = tree_differences(demo_root, second)
    assert diffs == [], f"{len(diffs)} difference(s):\n" + "\n".join(diffs)
    # And the covered-files comparison agrees, by address.
    assert compare_covered(demo_root, second, True) == []


def _every_node() -> list[tuple[str, str]]:
    return [(p.name, n.name) for p in sorted(PROFILES.glob("*.yaml"))
            for n in load_profile(p).cluster.nodes]


@pytest.mark.parametrize(("profile", "node_name"), _every_node(),
                         ids=[f"{p.removesuffix('.yaml')}-{n}" for p, n in _every_node()])
def test_every_bundled_profile_captures_back(tmp_path: Path, profile: str, node_name: str) -> None:
    """Every node of every bundled profile: render -> capture -> render, byte-identical
    (AMD GPUs, DFL FPGAs, SR-IOV GPUs and NICs with VFs on their drivers or vfio-pci, MIG
    partitions, generic devices with their device nodes)."""
    loaded = load_profile(PROFILES / profile)
    node = loaded.cluster.node(node_name, None)
    assert node is not None
    first, second = tmp_path / "first", tmp_path / "second"
    render(build_tree(node), first)
    result = capture(first, name=loaded.cluster.name, node_name=node.name)
    _render_captured(result, second)
    diffs = tree_differences(first, second)
    assert diffs == [], f"{len(diffs)} difference(s):\n" + "\n".join(diffs)
    spec = next(n for n in loaded.profile.nodes if n.name == node.base_name)
    captured = result.profile["nodes"][0]["devices"]
    drivers = [d["sriov"].get("vfDriver") for d in captured if "sriov" in d]
    assert drivers == [dev.sriov.vf_driver for dev in spec.devices
                       if getattr(dev, "sriov", None) is not None]
    partitioned = [[q["name"] for q in d["partitions"]["profiles"]] for d in captured
                   if "partitions" in d]
    assert partitioned == [[q.name for q in dev.partitions.profiles] for dev in spec.devices
                           if getattr(dev, "partitions", None) is not None]


def test_unknown_devices_are_generic_and_header_says_what_is_left_out(tmp_path: Path) -> None:
    loaded = load_profile(PROFILES / "workshop-mixed.yaml")
    node = loaded.cluster.node("net-worker", None)
    assert node is not None
    render(build_tree(node), tmp_path / "t")
    result = capture(tmp_path / "t", name="x", node_name="y")
    generic = [d for d in result.profile["nodes"][0]["devices"] if d["type"] == "generic"]
    assert generic == [{"type": "generic", "vendorId": 0x8086, "deviceId": 0x4940,
                        "classCode": 0x0B4000, "numaNode": 0, "driver": "4xxx",
                        "devNodes": [{"name": "qat_adf_ctl", "major": 10, "minor": 60}]}]
    header = [ln for ln in result.text.splitlines() if ln.startswith("#")]
    assert header[0].startswith("# Hardware profile captured by `sandbox capture`")
    assert any(f"from: {tmp_path / 't'}" in ln for ln in header)
    assert any("at:   20" in ln for ln in header)
    assert any("PCI bridge(s), which the resolver plans itself" in ln for ln in header)
    assert yaml.safe_load(result.text)["nodes"][0]["name"] == "y"


def test_not_a_machine_root_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match="not a machine root"):
        capture(tmp_path)
    with pytest.raises(CaptureError, match="not a directory"):
        capture(tmp_path / "missing")


def test_write_refuses_to_overwrite(demo_root: Path, tmp_path: Path) -> None:
    result = capture(demo_root)
    out = tmp_path / "p.yaml"
    out.write_text("mine\n")
    with pytest.raises(OutputError, match="exists; pass --force"):  # the one writer's
        write_capture(result, out)
    assert out.read_text() == "mine\n"
    write_capture(result, out, force=True)
    assert out.read_text() == result.text


def _sandbox(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_cli_writes_a_profile_that_validates(demo_root: Path, tmp_path: Path) -> None:
    root = demo_root
    before = snapshot(root)
    out = tmp_path / "out" / "captured.yaml"
    out.parent.mkdir()
    done = _sandbox("capture", "--root", str(root), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "captured" in done.stdout
    assert os.listdir(out.parent) == ["captured.yaml"]  # nothing but the -o file
    assert snapshot(root) == before
    checked = _sandbox("validate", str(out))
    assert checked.returncode == 0, checked.stderr
    again = _sandbox("capture", "--root", str(root), "-o", str(out))
    assert again.returncode == 1
    assert again.stderr.strip().splitlines() == [
        f"error: {out}: exists; pass --force to overwrite it"]
    assert _sandbox("capture", "--root", str(root), "-o", str(out), "--force").returncode == 0


def test_cli_host_capture_validates(tmp_path: Path) -> None:
    out = tmp_path / "host.yaml"
    done = _sandbox("capture", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert _sandbox("validate", str(out)).returncode == 0


@pytest.mark.parametrize("kind", ["empty", "missing", "file"])
def test_cli_bad_root_is_one_line(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "root"
    if kind == "empty":
        root.mkdir()
    elif kind == "file":
        root.write_text("x")
    out = tmp_path / "p.yaml"
    done = _sandbox("capture", "--root", str(root), "-o", str(out))
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: "), done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


def test_cli_help_explains() -> None:
    done = _sandbox("capture", "--help")
    assert done.returncode == 0
    for word in ("--root", "-o", "--force", "generic", "validated"):
        assert word in done.stdout


KEPT_ADDRESSES = """
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: kept}
nodes:
  - name: box
    cpu: {sockets: 2, coresPerSocket: 4, threadsPerCore: 2, vendor: AuthenticAMD,
          model: AMD EPYC 9654 96-Core Processor, family: 25, modelNumber: 17, mhz: 2400}
    numa:
      nodes:
        - {id: 0, memory: 8Gi}
        - {id: 1, memory: 8Gi, hugepages: {1Gi: 2}}
      distances: [[10, 32], [32, 10]]
    pci:
      hostBridges:
        - {bus: 0x00, numaNode: 0}
        - {bus: 0x40, numaNode: 0}
        - {bus: 0xa0, numaNode: 1}
    devices:
      - {type: gpu, vendor: nvidia, model: l40s, count: 2, numaNode: 0,
         pciAddresses: ["0000:41:00.0", "0000:00:03.0"]}
      - {type: gpu, vendor: nvidia, model: l40s, numaNode: 1, pciAddresses: ["0000:a0:01.0"]}
      - {type: nic, vendor: intel, model: e810-c, ports: 2, numaNode: 1,
         sriov: {totalVFs: 4, numVFs: 3}, pciAddresses: ["0000:a0:02.0"]}
      - {type: gpu, vendor: nvidia, model: t4, numaNode: 0, health: unhealthy,
         healthReason: aer-fatal, pciAddresses: ["0000:00:04.0"]}
      - {type: generic, vendorId: 0x1af4, deviceId: 0x1041, classCode: 0x020000,
         numaNode: 0, driver: virtio-pci, pciAddresses: ["0000:00:1f.0"]}
"""


def test_machine_addresses_are_kept(tmp_path: Path) -> None:
    """Devices the resolver would place elsewhere (as on a real machine or this VM, where
    they sit on the root bus) keep their addresses, and so do the host bridges; distances,
    1Gi hugepages, SR-IOV VFs and an unhealthy GPU come back too."""
    loaded = load_profile_text(KEPT_ADDRESSES)
    node = loaded.cluster.nodes[0]
    first, second = tmp_path / "first", tmp_path / "second"
    render(build_tree(node), first)
    result = capture(first, name="kept", node_name="box")
    assert result.pci_addresses == "machine"
    assert "hostBridges" in result.text
    assert "pciAddresses" in result.text
    _render_captured(result, second)
    diffs = tree_differences(first, second)
    assert diffs == [], f"{len(diffs)} difference(s):\n" + "\n".join(diffs)


NVME_DMI_SWAP = """
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: storage}
nodes:
  - name: box
    cpu: {sockets: 2, coresPerSocket: 4, threadsPerCore: 2}
    swap: 2Gi
    system: {vendor: Dell Inc., product: PowerEdge XE9680, chassisType: 23,
             bios: {version: 1.2.3, date: 01/02/2024}}
    numa:
      nodes:
        - {id: 0, memory: 8Gi}
        - {id: 1, memory: 8Gi}
      distances: [[10, 32], [32, 10]]
    devices:
      - {type: nvme, vendor: kioxia, model: cm6, count: 2, numaNode: 1, namespaces: 3,
         lbaSize: 4096, capacity: 3Ti}
      - {type: nvme, vendor: samsung, model: pm9a3, numaNode: 0}
      - {type: generic, vendorId: 0x1234, deviceId: 0x5678, classCode: 0x088000,
         numaNode: 1, driver: foo}
"""


def test_nvme_dmi_and_swap_capture_back(tmp_path: Path) -> None:
    """NVMe drives (namespaces, capacity, block size), the DMI identity, swap and NUMA
    distances are read back into the same profile fields."""
    node = load_profile_text(NVME_DMI_SWAP).cluster.nodes[0]
    first, second = tmp_path / "first", tmp_path / "second"
    render(build_tree(node), first)
    result = capture(first, name="storage", node_name="box")
    captured = result.profile["nodes"][0]
    assert captured["swap"] == "2Gi"
    assert captured["system"]["product"] == "PowerEdge XE9680"
    assert captured["numa"]["distances"] == [[10, 32], [32, 10]]
    nvmes = [d for d in captured["devices"] if d["type"] == "nvme"]
    assert nvmes[0] == {"type": "nvme", "vendor": "kioxia", "model": "cm6", "count": 2,
                        "numaNode": 1, "namespaces": 3, "capacity": "3Ti", "lbaSize": 4096}
    _render_captured(result, second)
    diffs = tree_differences(first, second)
    assert diffs == [], f"{len(diffs)} difference(s):\n" + "\n".join(diffs)


def test_a_numbering_the_tree_does_not_give_is_said(tmp_path: Path) -> None:
    """Siblings numbered next to each other (cpu0/cpu1 one core, as on many VMs and ARM
    machines): the profile can only say 1 x 2 x 2, the header says the numbering differs."""
    root = tmp_path / "root"
    for c in range(4):
        topo = root / CPU / f"cpu{c}" / "topology"
        topo.mkdir(parents=True)
        for name, value in {"physical_package_id": "0", "core_id": str(c // 2),
                            "thread_siblings_list": f"{c - c % 2}-{c - c % 2 + 1}"}.items():
            (topo / name).write_text(value + "\n")
    (root / CPU / "online").write_text("0-3\n")
    (root / "proc").mkdir()
    (root / "proc" / "cpuinfo").write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n"
                                           "model name\t: Some CPU\ncpu MHz\t\t: 2999.9\n")
    (root / "proc" / "meminfo").write_text("MemTotal:        4096 kB\n")
    result = capture(root, name="vm", node_name="vm")
    cpu = result.profile["nodes"][0]["cpu"]
    assert (cpu["sockets"], cpu["coresPerSocket"], cpu["threadsPerCore"]) == (1, 2, 2)
    assert cpu["mhz"] == 3000
    assert any(n.startswith("CPU numbering: cpu1 is package 0 core 0") for n in result.left_out)
    assert "# Left out or changed" in result.text


def test_nvidia_drm_nodes_capture_back(tmp_path: Path) -> None:
    """NVIDIA GPUs with nvidia-drm's DRM nodes (``drm: true``) next to an AMD GPU (which
    always has them)."""
    text = """
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: drm}
nodes:
  - name: box
    devices:
      - {type: gpu, vendor: nvidia, model: a100-sxm4-80gb, count: 2, drm: true}
      - {type: gpu, vendor: amd, model: mi210}
"""
    first, second = tmp_path / "first", tmp_path / "second"
    render(build_tree(load_profile_text(text).cluster.nodes[0]), first)
    result = capture(first, name="drm", node_name="box")
    devices = result.profile["nodes"][0]["devices"]
    assert [d.get("drm") for d in devices] == [True, None]
    _render_captured(result, second)
    diffs = tree_differences(first, second)
    assert diffs == [], f"{len(diffs)} difference(s):\n" + "\n".join(diffs)
