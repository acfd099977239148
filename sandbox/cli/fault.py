"""`sandbox fault ...`: change a running node's hardware (health, hotplug, VFs, kubelet)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from sandbox.cli._transport import add_transport_option, use_transport
from sandbox.errors import SandboxError
from sandbox.fakehw.changes import Change, next_state
from sandbox.fakehw.control import ControlClient
from sandbox.fakehw.control.scenario import (
    Action,
    PodHealth,
    Scenario,
    count_changes,
    load_scenario,
    run_scenario,
)
from sandbox.fakehw.states import state_from_json
from sandbox.fakehw.tree import DeviceState, Reason
from sandbox.runtimes.base import Runtime
from sandbox.session import find_session
from sandbox.textui import dump, table

REASONS = [r.value for r in Reason]
NODE_HELP = "the node (replica) name, as `sandbox fault list` and `sandbox status` show it"
DEVICE_HELP = "the device's id from the profile (gpu0, nic1...: `sandbox show PROFILE`)"
RUN_EPILOG = """\
A scenario is YAML (docs/control-api.md, "Scenarios"; a worked one:
examples/health/scenario.yaml):
    version: 1
    seed: 7                # storms draw the same changes every run
    steps:
      - {at: 0.5, do: health, device: gpu0, health: unhealthy, reason: aer-fatal}
      - {at: 1.0, do: unplug, device: nic0, repeat: 3, every: 2.0}
      - {at: 2.0, do: set-vfs, device: nic0, num_vfs: 4}
      - {at: 3.0, do: storm, changes: 100, over: 5.0, ops: [health, unplug, plug]}
      - {at: 9.0, expect: {gpu0: {plugged: true}}}
at, every and over are seconds from the start; do is health, unplug, plug, set-vfs or
storm (changes random changes over `over` seconds, of ops, on devices: default every
device of the node).
An expectation is either the state of devices, as `sandbox fault list` shows it:
    - {at: 9, expect: {gpu0: {plugged: true}, gpu1: {health: unhealthy}}}
or what a pod's status says of a device it was given (a 1.37 kubelet writes the health
of each allocated device into status.containerStatuses[].allocatedResourcesStatus):
    - {at: 12, expect: {pod: default/train, device: gpu3, health: Unhealthy}}
pod: NAMESPACE/NAME or NAME (namespace default); device: the profile's id (gpu3, nic0)
or the kubelet's resource id itself; health: Healthy, Unhealthy or Unknown; optional
container. It holds when the pod's status lists the device and every entry of it has
that health; it prints e.g.
    steps[2] at 12s: pod default/train gpu3 health Unhealthy: ok
    steps[2] at 12s: pod default/train gpu3 health Unhealthy: FAILED, got Healthy
    steps[2] at 12s: pod default/train gpu3 health Unhealthy: FAILED, no allocated
        device gpu3 in its status
Pod expectations ask the sandbox's API server (runtime native or kind; --name or the
only sandbox), so they cannot be used with --socket."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "fault",
        help="inject faults: device health, unplug/plug, SR-IOV VFs, kubelet restart",
        description="Change what a running sandbox's nodes look like, live. Devices are named "
        "by the stable ids `sandbox show` prints (gpu0, nic1...). Every change is visible to a "
        "fresh read of the node's /sys and /dev as soon as the command returns.",
    )
    p.add_argument("--name", help="which sandbox (default: the only one running)")
    p.add_argument("--socket", type=Path,
                   help="talk to this control socket directly (a `sandbox mount` server)")
    add_transport_option(p)
    verbs = p.add_subparsers(dest="fault", metavar="ACTION", required=True)

    h = verbs.add_parser("health", help="mark a device healthy or unhealthy")
    h.add_argument("node", help=NODE_HELP)
    h.add_argument("device", help=DEVICE_HELP)
    h.add_argument("health", choices=("healthy", "unhealthy"))
    h.add_argument("--reason", choices=REASONS,
                   help="how it shows: aer-fatal (PCI AER counters), link-down (net operstate), "
                   "port-down (IB port state), removed (falls off the bus); a GPU's ECC errors "
                   "row-remap-pending, row-remap-failure, ecc-contained, ecc-uncontained (NVML "
                   "Xid 63, 64, 94, 95; AER counters as aer-fatal); default aer-fatal")
    for name, text in (("unplug", "hot-unplug a device"), ("plug", "plug a device back")):
        q = verbs.add_parser(name, help=text)
        q.add_argument("node", help=NODE_HELP)
        q.add_argument("device", help=DEVICE_HELP)
    v = verbs.add_parser("set-vfs", help="change a device's number of SR-IOV VFs")
    v.add_argument("node", help=NODE_HELP)
    v.add_argument("device", help=DEVICE_HELP)
    v.add_argument("num_vfs", type=int, help="the new count, 0..sriov_totalvfs")
    v.add_argument("--port", type=int, metavar="N",
                   help="only physical function N (0-based) of a multi-port card, as the "
                   "kernel has one sriov_numvfs per function; default: every port")
    ls = verbs.add_parser("list", help="devices and their state, per node")
    ls.add_argument("node", nargs="?", help="only this node (default: every node)")
    ls.add_argument("-o", "--output", choices=("table", "wide", "json", "yaml"), default="table",
                    help="wide: with each device's vendor, model and VF count as set "
                    "(blank: the profile's)")
    w = verbs.add_parser("watch", help="print change events of a node as JSON lines")
    w.add_argument("node", help=NODE_HELP)
    r = verbs.add_parser(
        "run", help="run a fault scenario (timeline, storms, expectations)",
        description="Run a fault scenario file: its changes at their times, and its "
        "expectations, one line each; exit 1 if one is not met.",
        epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("scenario", type=Path, help="the scenario file (YAML; below)")
    r.add_argument("--node", help="node to run it on (default: the first)")
    r.add_argument("--speed", type=float, default=1.0, help="time multiplier (2 = twice as fast)")
    r.add_argument("-o", "--output", choices=("text", "json", "yaml"), default="text",
                   help="json/yaml: every expectation with its result, for CI (progress "
                   "stays on stderr)")
    r.add_argument("--progress", type=float, default=5.0, metavar="S",
                   help="say how far the scenario is on stderr every S seconds, during long "
                   "waits too (default 5; 0: never)")
    rs = verbs.add_parser(
        "reset", help="put devices back as the profile starts them",
        description="Put a node's devices (or one device) back in the state the sandbox's "
        "profile starts them in: plugged in (or not), healthy (or the profile's own fault), "
        "the profile's SR-IOV VF count, the profile's MIG mode and instances. Each device "
        "that changes is one ordinary change (plug, health, set-vfs, mig-reset), seen by "
        "plugins as any fault is; one line per device. "
        "Reads the sandbox's profile, so it takes --name, not --socket.")
    rs.add_argument("node", help=NODE_HELP)
    rs.add_argument("device", nargs="?", help="only this device (default: every device)")
    k = verbs.add_parser("restart-kubelet", help="restart the node's kubelet, then wait until "
                         "the plugins registered before have registered again")
    k.add_argument("node", help=NODE_HELP)
    k.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="how long to wait for the plugins to register again (default 30; "
                   "exit 1 if they have not)")
    p.set_defaults(func=run)


@contextlib.contextmanager
def _client(args: argparse.Namespace, node: str | None) -> Iterator[ControlClient]:
    if args.socket is not None:  # the server refuses a node it does not serve
        with ControlClient(args.socket, node=node) as client:
            yield client
        return
    session = find_session(args.name)
    if node is None:
        node = next(iter(session.nodes), None)
        if node is None:
            raise SandboxError(f"sandbox {session.name!r} has no nodes")
    with session.control(node) as sock, ControlClient(sock) as client:
        yield client


def run(args: argparse.Namespace) -> int:
    use_transport(args)
    action = args.fault
    if action == "restart-kubelet":
        from sandbox.runtimes import runtime_for

        session = find_session(args.name)
        return _restart_kubelet(runtime_for(session.runtime), session.state_dir, args.node,
                                args.timeout)
    if action == "list":
        return _list(args)
    if action == "reset":
        return _reset(args)
    node = getattr(args, "node", None)
    scenario, pod_health = None, None
    if action == "run":  # every problem with the file or the sandbox before anything runs
        scenario = load_scenario(args.scenario)
        pod_health = _pod_health(args, scenario)
    with _client(args, node) as client:
        if action == "health":
            reason = args.reason or ("aer-fatal" if args.health == "unhealthy" else None)
            reply = client.health(args.device, args.health, reason)
        elif action == "unplug":
            reply = client.unplug(args.device)
        elif action == "plug":
            reply = client.plug(args.device)
        elif action == "set-vfs":
            reply = client.set_vfs(args.device, args.num_vfs, args.port)
        elif action == "watch":
            for event in client.watch():
                print(json.dumps(event), flush=True)
            return 0
        elif action == "run":
            assert scenario is not None
            progress = _Progress(count_changes(scenario.steps), args.progress, args.speed)
            result = run_scenario(scenario, client, speed=args.speed,
                                  on_action=progress.applied, on_wait=progress.waiting,
                                  wait_slice=min(1.0, args.progress) if args.progress > 0 else 1.0,
                                  pod_health=pod_health)
            met = len(result.checks) - len(result.failures)
            if args.output != "text":
                dump({"ok": result.ok, "applied": len(result.applied), "met": met,
                       "expectations": [{"ok": c.ok, "line": str(c), **dataclasses.asdict(c)}
                                        for c in result.checks]}, args.output)
                return 0 if result.ok else 1
            for check in result.checks:
                print(check)
            print(f"{len(result.applied)} change(s) applied, {met} of {len(result.checks)} "
                  "expectation(s) met")
            return 0 if result.ok else 1
        else:  # pragma: no cover - argparse restricts the choices
            raise SandboxError(f"unknown fault action {action!r}")
    what = "no change" if not reply.get("changed", True) else "done"
    print(f"{node}/{args.device}: {_describe(reply.get('state', {}))} [{what}]")
    return 0


def _describe(state: dict[str, Any]) -> str:
    desc = "unplugged" if not state.get("plugged", True) else str(state.get("health", "?"))
    if state.get("reason"):
        desc += f" ({state['reason']})"
    ports = state.get("port_vfs") or {}
    if ports:
        desc += ", VFs " + ", ".join(f"port {p}: {n}" for p, n in sorted(ports.items()))
        if state.get("num_vfs") is not None:
            desc += f", other ports: {state['num_vfs']}"
    elif state.get("num_vfs") is not None:
        desc += f", {state['num_vfs']} VFs"
    return desc


def _reset(args: argparse.Namespace) -> int:
    if args.socket is not None:
        raise SandboxError("fault reset puts devices back as the sandbox's profile starts "
                           "them; --socket has no profile (use --name)")
    from sandbox.fakehw.states import initial_states
    from sandbox.profile import load_profile

    session = find_session(args.name)
    session.socket(args.node)  # raises naming the known nodes
    spec = load_profile(session.record.profile).cluster.node(args.node)
    if spec is None:
        raise SandboxError(f"node {args.node!r} is not in the profile "
                           f"{session.record.profile}")
    starts = initial_states(spec)
    vfs = {d.id: sriov.num_vfs for d in spec.devices
           if (sriov := d.nic or d.gpu) is not None and sriov.total_vfs}
    with session.control(args.node) as sock, ControlClient(sock) as client:
        devices = client.devices()
        if args.device is not None and args.device not in devices:
            raise SandboxError(f"{args.node}: no device {args.device!r} (have "
                               f"{', '.join(sorted(devices))})")
        for dev in [args.device] if args.device else sorted(devices):
            now = state_from_json(devices[dev].get("state"), dev)
            changed = False
            for step in _reset_steps(dev, now, starts.get(dev, DeviceState()), vfs.get(dev)):
                changed |= bool(step(client).get("changed", True))
            state = client.devices()[dev].get("state", {})
            print(f"{args.node}/{dev}: {_describe(state)} [{'done' if changed else 'no change'}]")
    return 0


def _reset_steps(dev: str, now: DeviceState, start: DeviceState, num_vfs: int | None,
                 ) -> list[Callable[[ControlClient], dict[str, Any]]]:
    """The changes that take device ``dev`` from ``now`` back to ``start`` (the profile's
    state), in an order the server's rules allow (``next_state``): plugged in first (a
    plug of a device that fell off the bus also heals it), then its health, then unplugged
    if the profile starts it so, then its VF count (``num_vfs``: the profile's; None: no
    SR-IOV), then its MIG mode and instances (as NVML calls may have changed them)."""
    steps: list[Callable[[ControlClient], dict[str, Any]]] = []
    cur = now
    if not cur.plugged and start.plugged:
        steps.append(lambda c: c.plug(dev))
        cur = next_state(cur, Change("plug", dev))
    if (cur.health, cur.reason) != (start.health, start.reason):
        reason = start.reason.value if start.reason else None
        steps.append(lambda c: c.health(dev, start.health.value, reason))
        cur = next_state(cur, Change("health", dev, health=start.health, reason=start.reason))
    if cur.plugged and not start.plugged:
        steps.append(lambda c: c.unplug(dev))
    if num_vfs is not None and (now.port_vfs or now.num_vfs not in (None, num_vfs)):
        steps.append(lambda c: c.set_vfs(dev, num_vfs))
    if now.mig_mode is not None or now.mig is not None:  # NVML changed its MIG instances
        steps.append(lambda c: c.request("mig-reset", device=dev))
    return steps


def _pod_health(args: argparse.Namespace, scenario: Scenario) -> PodHealth | None:
    """What answers the scenario's pod expectations (None: it has none): the sandbox's
    API server, its pods' devices matched to the profile's ids. SandboxError, before
    anything runs, where there is no API server to ask."""
    pods = [st for st in scenario.steps if st.pod_expect is not None]
    if not pods:
        return None
    first = f"{scenario.source}:{pods[0].where}" if pods[0].where else scenario.source
    if args.socket is not None:
        raise SandboxError(f"{first}: {pods[0].pod_expect}: a pod expectation asks the "
                           "sandbox's Kubernetes API server; --socket has none (use --name)")
    session = find_session(args.name)
    kubeconfig = session.record.kubeconfig
    if not kubeconfig:
        raise SandboxError(f"{first}: {pods[0].pod_expect}: sandbox {session.name!r} runs "
                           f"the {session.runtime} runtime, which has no API server and no "
                           "pods; use --runtime native or kind")
    from sandbox.podhealth import PodHealthLookup
    from sandbox.profile import load_profile

    cluster = None
    try:
        cluster = load_profile(session.record.profile).cluster
    except (SandboxError, OSError) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"note: profile: {first_line}; pod expectations match resource ids only",
              file=sys.stderr)
    return PodHealthLookup(str(kubeconfig), cluster)


class _Progress:
    """Says how far a scenario run is (stderr), at most every ``every`` seconds, after
    changes and while waiting for the next one, so a long run never looks stuck."""

    def __init__(self, total: int, every: float, speed: float) -> None:
        self.total = total
        self.every = every
        self.speed = speed
        self.done = 0
        self.start = self.last = time.monotonic()

    def applied(self, action: Action, _reply: dict[str, Any]) -> None:
        self.done += 1
        self._say(f"(at {action.at:g}s)")

    def waiting(self, upcoming: Action) -> None:
        self._say(f"at {(time.monotonic() - self.start) * self.speed:.0f}s; next at "
                  f"{upcoming.at:g}s (steps[{upcoming.step}])")

    def _say(self, where: str) -> None:
        now = time.monotonic()
        if self.every <= 0 or now - self.last < self.every:
            return
        self.last = now
        print(f"  {self.done} of {self.total} change(s) applied {where}", file=sys.stderr,
              flush=True)


def _mig_cell(info: dict[str, Any]) -> str:
    """A MIG GPU's instances for ``fault list``: ``gi1 3g.40gb@0, gi5 1g.10gb@6 (no CI)``;
    ``off`` in MIG mode off; empty for other devices."""
    if "mig_mode" not in info:
        return ""
    if not info["mig_mode"]:
        return "off"
    cells = [f"gi{g['gi']} {g['profile']}@{g['start']}" + ("" if g["ci"] else " (no CI)")
             for g in info.get("mig") or ()]
    return ", ".join(cells) or "none"


def _list(args: argparse.Namespace) -> int:
    nodes: dict[str, Callable[[], AbstractContextManager[Path]]]
    if args.socket is not None:
        nodes = {args.node or "-": lambda: contextlib.nullcontext(args.socket)}
    else:
        session = find_session(args.name)
        nodes = {n: functools.partial(session.control, n) for n in session.nodes
                 if args.node in (None, n)}
        if args.node and not nodes:
            session.socket(args.node)  # raises with the known nodes
    rows = []
    migs: list[str] = []
    data = {}
    for node, reach in nodes.items():
        with reach() as sock, ControlClient(sock, node=None if node == "-" else node) as client:
            reply = client.get()
        devices = {d["id"]: d for d in reply["devices"]}
        if node == "-" and isinstance(reply.get("node"), str) and reply["node"].isprintable():
            node = reply["node"]  # what the server behind --socket says it serves
        data[node] = devices
        for dev_id, info in devices.items():
            state = info.get("state", {})
            health = "unplugged" if not state.get("plugged", True) else state.get("health")
            row: tuple[object, ...] = (node, dev_id, info.get("kind", ""),
                                       info.get("pci_address", ""), info.get("numa_node", ""),
                                       health, state.get("reason") or "")
            if args.output == "wide":
                ports = state.get("port_vfs") or {}
                vfs = ", ".join(f"port {p}: {n}" for p, n in sorted(ports.items())) \
                    if ports else state.get("num_vfs")
                row += (info.get("vendor", ""), info.get("model", ""),
                        "" if vfs is None else vfs)
            migs.append(_mig_cell(info))
            rows.append(row)
    headers = ("NODE", "DEVICE", "KIND", "PCI ADDRESS", "NUMA", "HEALTH", "REASON")
    if args.output in ("json", "yaml"):
        dump(data, args.output)
    else:
        wide: tuple[str, ...] = ("VENDOR", "MODEL", "VFS") if args.output == "wide" else ()
        if any(migs):  # MIG GPUs: their live GPU instances (docs/nvml.md, "Dynamic MIG")
            rows = [(*row, mig) for row, mig in zip(rows, migs, strict=True)]
            wide += ("MIG",)
        print(table((*headers, *wide), rows))
    return 0


def _restart_kubelet(runtime: Runtime, state_dir: Path, node: str, timeout: float) -> int:
    """Restart, then report whether (and when) every plugin registered before has
    registered with the new kubelet again."""
    before = runtime.registered_plugins(state_dir, node)
    started = time.monotonic()
    runtime.restart_kubelet(state_dir, node)
    print(f"{node}: kubelet restarted", flush=True)
    if not before:
        print(f"{node}: no plugins were registered before the restart")
        return 0
    missing = set(before)
    while time.monotonic() - started < timeout:
        missing = set(before) - runtime.registered_plugins(state_dir, node)
        if not missing:
            print(f"{node}: {len(before)} plugin registration(s) back after "
                  f"{time.monotonic() - started:.1f}s: {', '.join(sorted(before))}")
            return 0
        time.sleep(0.2)
    print(f"error: {node}: not registered again after {timeout:.0f}s: "
          f"{', '.join(sorted(missing))}", file=sys.stderr)
    return 1
