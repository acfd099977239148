"""`sandbox status`: what each node's kubelet advertises, devices per NUMA node, health, and
what a real kubelet decided: which container holds which devices and exclusive CPUs (its
pod-resources API, ``sandbox.podresources``)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sandbox.cli._transport import add_transport_option, use_transport
from sandbox.draw import DeviceView, NodeView, ResourceView, svg_to_png, topology_svg
from sandbox.errors import SandboxError
from sandbox.outfile import check_target, write_file
from sandbox.podhealth import PodDeviceHealth, device_names, read_sandbox_pod_health
from sandbox.podresources import natural
from sandbox.profile.cpulist import format_cpulist
from sandbox.profile.spec import Cluster, NodeSpec, read_cluster
from sandbox.runtimes import runtime_for
from sandbox.runtimes.base import NodeStatus, Runtime, SandboxStatus
from sandbox.session import Session, find_session
from sandbox.textui import dump, size, table

RUNTIME_NOTE = {
    "local": "FUSE trees + reference device plugin + kubelet harness; no Kubernetes",
    "native": "real Kubernetes components as host processes",
    "kind": "kind cluster in Docker",
}

EXPLAIN = """\
With a real kubelet (runtimes native and kind), each node also shows what the kubelet
decided, from its pod-resources API (<kubelet root>/pod-resources/kubelet.sock; root only):
an allocations table (POD, CONTAINER, RESOURCE, DEVICES by the profile's names where known,
their NUMA nodes, the container's exclusive CPUS with the NUMA nodes the profile puts them
on; MEMORY where the memory manager pinned some) and a line of exclusive CPUs per NUMA
node: allocatable (all the CPU manager may hand out) and held. A container's CPUs are on
its first row; one holding CPUs but no devices has a row of resource "cpu". Where the API
cannot be asked, a "! pod-resources: ..." line says why. -o json gives per node
"allocations" ([{namespace, pod, container, resource, devices (the plugin's ids), numa,
cpus, memory}]) and "allocatable" ({devices: {resource: [{id, numa}]}, cpus, memory};
null: not asked), and fills devices[].allocated_to; svg/png mark held devices and CPUs.

They also show whether a fault reached the pods: a 1.37 kubelet writes the health of
each device it gave a container into the pod's status (allocatedResourcesStatus), read
from the sandbox's API server. Under each node, "pods with unhealthy devices:" lists the
entries that are not Healthy (POD, CONTAINER, RESOURCE: the extended resource or DRA
"claim:<claim>[/<request>]", DEVICE: the profile's id where known, else the kubelet's
resource id, HEALTH: Unhealthy or Unknown, MESSAGE: the DRA driver's); one line when all
are Healthy, nothing when no pod reports any. -o json gives per node "pod_health":
[{namespace, pod, node, container, resource, resource_id, health, message, device (the
profile's id, "" when unknown)}], every entry, Healthy ones too (null: not asked, e.g.
runtime local, or the API server did not answer, which a "! pod health: ..." note says).
svg/png put a red "!" on a device some pod's status reports Unhealthy.
The exit code is 1 when a node is not Ready, whatever the pod-resources API or the pods'
status say."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="show nodes, devices per NUMA node, health, capacity vs allocatable, and which "
        "pod holds which devices and CPUs",
        description="Show a running sandbox. --output svg|png draws it as a 16:9 slide: per node\n"
        "its Ready state and each resource's capacity and allocatable, NUMA nodes, CPUs, PCI,\n"
        "devices coloured by their live health, their VF counts and who holds them.",
        epilog=EXPLAIN + "\nExit code: 1 when a node is not Ready or one of the sandbox's "
        "processes is not\nrunning (every output), else 0.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--name", help="which sandbox (default: the only one running)")
    add_transport_option(p)
    p.add_argument("-o", "--output", choices=("table", "json", "yaml", "svg", "png"),
                   default="table")
    p.add_argument("-w", "--watch", nargs="?", const=2.0, type=float, metavar="S",
                   help="look again every S seconds (default 2) and print the status each "
                   "time it changed (-o json: one line each) until Ctrl-C")
    p.add_argument("--pod", metavar="NAMESPACE/NAME",
                   help="only this pod's allocations, asked with the kubelet's Get RPC "
                   "(NAME alone: namespace default); an error if no node's kubelet knows it")
    add_file_arguments(p)
    p.set_defaults(func=run)


def add_file_arguments(p: argparse.ArgumentParser) -> None:
    """``--file``, ``--force`` and ``--scale`` of a command that draws svg/png (status, dra
    claims)."""
    p.add_argument("-f", "--file", metavar="FILE",
                   help="write svg/png here (default: stdout): a new regular file renamed "
                   "into place; a directory, FIFO, device, socket or symbolic link there "
                   "is refused")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --file (a regular file, never a link)")
    p.add_argument("--scale", type=_scale, metavar="N",
                   help="svg/png: output pixels per unit of the drawing, where no text is "
                   "smaller than 12 px at 1 (default: as large as fits 1920x1080, at least 1)")


def _scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0.1 <= value <= 10:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number from 0.1 to 10, "
                                         "e.g. 1.5")
    return value


def check_picture_file(args: argparse.Namespace) -> None:
    """Refuse a bad --file before any work is done (``write_picture`` checks again)."""
    if args.file is not None and args.output in ("svg", "png"):
        check_target(args.file, args.force)


def text(status: SandboxStatus, cluster: Cluster | None = None, pod: str | None = None,
         health: Mapping[str, Sequence[PodDeviceHealth]] | None = None) -> str:
    """The table output. ``cluster`` (the resolved spec, where it reads) maps the kubelet's CPU
    ids to NUMA nodes; ``pod``: only that pod's allocations are in ``status`` (--pod);
    ``health``: node name -> its pods' device health (a node missing: not asked)."""
    out = [f"sandbox {status.name}  runtime: {status.runtime} "
           f"({RUNTIME_NOTE.get(status.runtime, '')})  profile: {status.profile}"]
    for node in status.nodes:
        out.append("")
        out.append(f"node {node.name}  {'Ready' if node.ready else 'NotReady'}")
        out.extend(f"  ! {n}" for n in node.notes)
        if node.resources:
            numas = sorted({k for r in node.resources for k in r.by_numa})
            rows = [(r.resource, r.capacity, r.allocatable,
                     *(r.by_numa.get(k, 0) for k in numas)) for r in node.resources]
            out.append(table(("RESOURCE", "CAPACITY", "ALLOCATABLE",
                              *(f"HEALTHY@NUMA{k}" if k >= 0 else "HEALTHY@NO-NUMA"
                                for k in numas)), rows, indent="  "))
        else:
            out.append("  (no extended resources advertised)")
        by_numa: dict[int, list[str]] = defaultdict(list)
        for d in node.devices:
            reason = f": {d.reason}" if d.reason else ""
            mark = "" if d.health == "healthy" else f" [{d.health}{reason}]"
            by_numa[d.numa_node].append(f"{d.id}{mark}")
        for numa in sorted(by_numa, key=lambda k: (k < 0, k)):
            where = f"NUMA {numa}" if numa >= 0 else "no NUMA affinity"
            out.append(f"  {where}: {', '.join(by_numa[numa])}")
        spec = cluster.node(node.name) if cluster is not None else None
        out.extend(allocation_lines(node, cpu_numa(spec), pod, whole_device_names(spec)))
        if health is not None and node.name in health:
            out.extend(pod_health_lines(health[node.name]))
    return "\n".join(out) + "\n"


def pod_health_lines(entries: Sequence[PodDeviceHealth]) -> list[str]:
    """The entries of the pods' status that are not Healthy, as a table (one line when
    all are; nothing when no pod reports a device's health)."""
    if not entries:
        return []
    bad = [h for h in entries if h.health != "Healthy"]
    if not bad:
        pods = len({(h.namespace, h.pod) for h in entries})
        return [f"  pods' devices: all {len(entries)} Healthy ({pods} pod(s), the kubelet's "
                "allocatedResourcesStatus)"]
    rows = [(f"{h.namespace}/{h.pod}", h.container, h.resource, h.device or h.resource_id,
             h.health, h.message or "-") for h in bad]
    return ["  pods with unhealthy devices (their status, allocatedResourcesStatus):",
            table(("POD", "CONTAINER", "RESOURCE", "DEVICE", "HEALTH", "MESSAGE"), rows,
                  indent="  ")]


def pod_unhealthy(entries: Sequence[PodDeviceHealth]) -> dict[str, str]:
    """The profile's device id -> the pods whose status reports it Unhealthy."""
    pods: dict[str, list[str]] = defaultdict(list)
    for h in entries:
        if h.health == "Unhealthy" and h.device and f"{h.namespace}/{h.pod}" not in pods[h.device]:
            pods[h.device].append(f"{h.namespace}/{h.pod}")
    return {dev: ", ".join(p) for dev, p in pods.items()}


def read_health(kubeconfig: str | None, status: SandboxStatus, cluster: Cluster | None,
                pod: tuple[str, str] | None = None) -> dict[str, list[PodDeviceHealth]] | None:
    """Every node's pods' device health from the sandbox's API server (None: it has none,
    or it did not answer: a "pod health: ..." note on every node says so); ``pod``: only
    that pod's."""
    if not kubeconfig:
        return None
    try:
        found = read_sandbox_pod_health(kubeconfig, cluster)
    except SandboxError as exc:
        for node in status.nodes:
            node.notes.append(f"pod health: {exc}")
        return None
    return {n.name: [h for h in found.get(n.name, [])
                     if pod is None or (h.namespace, h.pod) == pod] for n in status.nodes}


def to_json(status: SandboxStatus,
            health: Mapping[str, Sequence[PodDeviceHealth]] | None = None) -> dict[str, Any]:
    """``-o json``: ``status`` with each node's ``pod_health`` (null: not asked)."""
    out = status.to_dict()
    for data in out["nodes"]:
        entries = health.get(data["name"]) if health is not None else None
        data["pod_health"] = [h.to_dict() for h in entries] if entries is not None else None
    return out


def whole_device_names(spec: NodeSpec | None) -> dict[str, str]:
    """A plugin's id of a whole device (GPU UUID, PCI address, /dev node name) -> the
    profile's device id (``gpu0``), for a table a workshop can read; a VF or an FPGA port
    keeps its own id."""
    if spec is None:
        return {}
    names = {}
    for d in spec.devices:
        for name in (d.uuid, d.address, d.id):
            names[name] = d.id
        if d.gpu is not None and d.vendor == "nvidia":
            names[f"nvidia{d.gpu.minor}"] = d.id
        if d.gpu is not None and d.gpu.drm_index >= 0:
            names[f"card{d.gpu.drm_index}"] = d.id
    names.pop("", None)
    return names


def allocation_lines(node: NodeStatus, numa_of: Mapping[int, int],
                     pod: str | None = None, names: Mapping[str, str] | None = None
                     ) -> list[str]:
    """What the node's kubelet decided (nothing where it was not asked: no real kubelet,
    or it did not answer, which a note says): the allocations table and the exclusive
    CPUs per NUMA node (``numa_of``: CPU id -> NUMA node, where known; ``names``: the
    plugin's device ids -> the profile's, where known: ``-o json`` has the plugin's)."""
    if node.allocatable is None:
        return []
    names = names or {}
    out = []
    if node.allocations:
        memory = any(a.memory for a in node.allocations)
        rows = [(f"{a.namespace}/{a.pod}", a.container, a.resource,
                 ",".join(sorted((names.get(d, d) for d in a.devices), key=natural)) or "-",
                 ",".join(map(str, a.numa)) or "-", _cpus(a.cpus, numa_of),
                 *([", ".join(f"{m.type}={size(m.size)}@{','.join(map(str, m.numa)) or '?'}"
                              for m in a.memory) or "-"] if memory else []))
                for a in node.allocations]
        out.append("  allocations (the kubelet's pod-resources API):")
        out.append(table(("POD", "CONTAINER", "RESOURCE", "DEVICES", "NUMA", "CPUS",
                          *(["MEMORY"] if memory else [])), rows, indent="  "))
    elif pod is not None:
        out.append(f"  (pod {pod} holds no devices or exclusive CPUs on this node)")
    else:
        out.append("  (no pod holds devices or exclusive CPUs)")
    out.append(_cpu_line(node.allocatable.cpus, {c for a in node.allocations for c in a.cpus},
                         numa_of))
    return out


def _cpus(cpus: Sequence[int], numa_of: Mapping[int, int]) -> str:
    if not cpus:
        return "-"
    numas = sorted({numa_of[c] for c in cpus if c in numa_of})
    where = f" (NUMA {','.join(map(str, numas))})" if numas else ""
    return format_cpulist(cpus) + where


def _cpu_line(allocatable: Sequence[int], held: set[int], numa_of: Mapping[int, int]) -> str:
    if not allocatable:
        return ("  exclusive CPUs: none allocatable (the kubelet's CPU manager policy is not "
                "static)")
    if not numa_of:
        return (f"  exclusive CPUs: {format_cpulist(allocatable)} ({len(allocatable)} "
                f"allocatable, {len(held)} held)")
    by_numa: dict[int | str, list[int]] = defaultdict(list)
    for c in allocatable:
        by_numa[numa_of.get(c, "?")].append(c)
    parts = [f"NUMA {k}: {format_cpulist(cpus)} ({len(cpus)} allocatable, "
             f"{len(held.intersection(cpus))} held)"
             for k, cpus in sorted(by_numa.items(), key=lambda kv: str(kv[0]))]
    return "  exclusive CPUs: " + "; ".join(parts)


def cpu_numa(spec: NodeSpec | None) -> dict[int, int]:
    """CPU id -> NUMA node, as the profile lays the node out (empty: no profile)."""
    return {c.id: c.numa_node for c in spec.cpus} if spec is not None else {}


def mark_holders(status: SandboxStatus, cluster: Cluster | None) -> None:
    """Fill each device's ``allocated_to`` from the kubelet's allocations: who holds it
    or a part of it (a VF, an FPGA port), matched through ``device_names``."""
    for node in status.nodes:
        spec = cluster.node(node.name) if cluster is not None else None
        if spec is None or not node.allocations:
            continue
        owner = {name: d.id for d in spec.devices for name in device_names(d)}
        holders: dict[str, list[str]] = defaultdict(list)
        for a in node.allocations:
            for dev in a.devices:
                dev_id = owner.get(dev)
                if dev_id is not None and a.holder not in holders[dev_id]:
                    holders[dev_id].append(a.holder)
        for d in node.devices:
            if d.id in holders:
                d.allocated_to = ", ".join(holders[d.id])


def held_cpus(node: NodeStatus) -> dict[int, str]:
    """CPU id -> the container that holds it exclusively."""
    return {c: a.holder for a in node.allocations for c in a.cpus}


def parse_pod(text: str) -> tuple[str, str]:
    namespace, _, name = text.rpartition("/")
    namespace = namespace or "default"
    if not name or "/" in namespace:
        raise SandboxError(f"--pod {text!r}: expected NAMESPACE/NAME, e.g. default/train")
    return namespace, name


def only_pod(runtime: Runtime, state_dir: Path, status: SandboxStatus, namespace: str,
             name: str) -> None:
    """Replace every node's allocations with the pod's (the Get RPC of each node's kubelet
    that answered List); SandboxError when none of them knows the pod."""
    from sandbox.podresources import get_pod

    asked = [n for n in status.nodes if n.allocatable is not None]
    if not asked:
        if all(runtime.pod_resources_socket(state_dir, n.name) is None for n in status.nodes):
            raise SandboxError(f"--pod asks a real kubelet; the {status.runtime} runtime runs "
                               "none (use --runtime native or kind)")
        raise SandboxError(f"--pod {namespace}/{name}: no node's kubelet answers its "
                           "pod-resources API (see `sandbox status`)")
    problems, found = [], False
    for node in status.nodes:
        node.allocations = []
        socket = runtime.pod_resources_socket(state_dir, node.name)
        if node.allocatable is None or socket is None:
            continue
        try:
            with runtime.reach(state_dir, node.name, socket) as reached:
                node.allocations = get_pod(reached, namespace, name)
            found = True
        except SandboxError as exc:
            problems.append(f"{node.name}: {exc}" if len(asked) > 1 else str(exc))
    if not found:
        raise SandboxError("; ".join(problems))


def spec_files(session: Session) -> list[Path]:
    """Where the runtime wrote the spec the sandbox was brought up with (what its servers
    read): ``state_dir/spec.json`` (local: the cluster; native: its node), else one per
    replica, ``state_dir/nodes/<replica>/spec.json`` (kind), in the record's order."""
    whole = session.state_dir / "spec.json"
    if whole.exists():
        return [whole]
    files = [session.state_dir / "nodes" / name / "spec.json"
             for name in session.record.nodes]
    if not files:
        raise SandboxError(f"{session.state_dir}: no resolved spec (spec.json) yet")
    return files


def _spec(session: Session, status: SandboxStatus, needed: bool,
          wanted: bool = False) -> Cluster | None:
    """The resolved spec the sandbox was brought up with (never the profile resolved again:
    it may have changed since): for svg/png it must read; else only where a kubelet told
    something to map onto it (``wanted``: the pods' device health will), and a failure is
    a note on stderr."""
    if not needed and not wanted and all(n.allocatable is None for n in status.nodes):
        return None
    try:
        return read_cluster(spec_files(session), status.name)
    except (SandboxError, OSError) as exc:
        if needed:
            raise
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"note: {first}; devices and CPUs are not matched to the profile",
              file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    use_transport(args)
    check_picture_file(args)
    if args.watch is not None:
        if args.output not in ("table", "json"):  # (yaml: no one-line form to watch)
            raise SandboxError("--watch prints tables or JSON lines, not pictures")
        if args.watch <= 0:
            raise SandboxError(f"--watch {args.watch:g}: the interval must be above 0 seconds")
        return _watch(args)
    return _once(args)


def _watch(args: argparse.Namespace) -> int:
    """``status`` again every ``args.watch`` seconds, printed when it changed (a table
    under a time line; JSON as one line), until Ctrl-C; the last exit code."""
    last, code = None, 0
    try:
        while True:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = _once(args, compact=True)
            if out.getvalue() != last:
                last = out.getvalue()
                if args.output == "table":
                    print(f"--- {time.strftime('%H:%M:%S')} ---")
                print(last, end="", flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return code


def _once(args: argparse.Namespace, compact: bool = False) -> int:
    pod = parse_pod(args.pod) if args.pod else None
    session = find_session(args.name)
    runtime = runtime_for(session.runtime)
    status = runtime.status(session.state_dir)
    # scripts can test the status: 1 when a node is not Ready or a process of ours is down
    ready = 0 if all(n.ready and not n.down for n in status.nodes) else 1
    if pod is not None:
        only_pod(runtime, session.state_dir, status, *pod)
    picture = args.output in ("svg", "png")
    kubeconfig = session.record.kubeconfig
    cluster = _spec(session, status, picture, wanted=bool(kubeconfig))
    mark_holders(status, cluster)
    health = read_health(str(kubeconfig) if kubeconfig else None, status, cluster, pod)
    if args.output == "json":
        json.dump(to_json(status, health), sys.stdout, indent=None if compact else 2)
        print()
        return ready
    if args.output == "yaml":
        dump(to_json(status, health), "yaml")
        return ready
    if args.output == "table":
        sys.stdout.write(text(status, cluster, "/".join(pod) if pod else None, health))
        return ready
    assert cluster is not None  # _spec raises for a picture
    write_picture(picture_svg(status, cluster, health, args.scale), args.output, args.file,
                  args.force)
    return ready


def picture_svg(status: SandboxStatus, cluster: Cluster,
                health: Mapping[str, Sequence[PodDeviceHealth]] | None = None,
                scale: float | None = None) -> str:
    """``-o svg``: the profile's nodes as ``status`` finds them now; a device ``status``
    does not list (its node's server did not answer) is drawn as "state unknown"."""
    unhealthy = {n: pod_unhealthy(entries) for n, entries in (health or {}).items()}
    views: dict[str, dict[str, DeviceView]] = {}
    for n in status.nodes:
        spec = cluster.node(n.name)
        views[n.name] = {d.id: DeviceView("unknown") for d in spec.devices} if spec else {}
        for d in n.devices:
            views[n.name][d.id] = DeviceView(
                d.health, d.reason, d.allocated_to, unhealthy.get(n.name, {}).get(d.id, ""),
                num_vfs=d.num_vfs, port_vfs=tuple(sorted(d.port_vfs.items())))
    live = {n.name: NodeView(n.ready, tuple(ResourceView(r.resource, r.capacity,
                                                         r.allocatable, r.by_numa)
                                            for r in n.resources), tuple(n.notes))
            for n in status.nodes}
    return topology_svg(cluster.nodes, views, title=f"{status.name} ({status.runtime})",
                        cpus={n.name: held_cpus(n) for n in status.nodes}, live=live,
                        scale=scale)


def write_picture(svg: str, output: str, file: str | None, force: bool = False) -> None:
    """``svg`` as ``output`` ("svg" or "png") to ``file`` (``sandbox.outfile.write_file``:
    an existing one only with ``force``), else to stdout (never PNG bytes to a terminal)."""
    data = svg.encode() if output == "svg" else svg_to_png(svg)
    if file is not None:
        write_file(file, data, force=force)
        print(f"wrote {file}", file=sys.stderr)
    elif output == "png" and sys.stdout.isatty():
        raise SandboxError("refusing to write PNG to a terminal; use --file or a redirect")
    else:
        sys.stdout.buffer.write(data)
