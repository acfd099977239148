"""Device states on disk and in the control API: JSON (de)serialisation, the atomic
state file a server keeps across restarts, the device list ``get`` reports, and the
states a profile starts its devices in."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandbox.errors import ControlError
from sandbox.fakehw import mig as migrule
from sandbox.fakehw.tree import DeviceRecord, DeviceState, GpuInstance, Health, Reason

if TYPE_CHECKING:
    from sandbox.profile.spec import NodeSpec

STATE_FILE_VERSION = 1


def initial_states(node: NodeSpec) -> dict[str, DeviceState]:
    """Device states as the profile starts them (health and reason per device)."""
    states: dict[str, DeviceState] = {}
    for d in node.devices:
        if d.health == "unhealthy":
            reason = Reason(d.health_reason or "aer-fatal")
            if reason is Reason.REMOVED:
                states[d.id] = DeviceState(plugged=False)
            else:
                states[d.id] = DeviceState(health=Health.UNHEALTHY, reason=reason)
    return states


def state_to_json(state: DeviceState) -> dict[str, Any]:
    out: dict[str, Any] = {
        "health": state.health.value,
        "reason": state.reason.value if state.reason else None,
        "plugged": state.plugged,
        "num_vfs": state.num_vfs,
    }
    if state.port_vfs:  # only once a port was set apart: older readers see what they knew
        out["port_vfs"] = {str(p): n for p, n in state.port_vfs}
    if state.mig_mode is not None:  # only once NVML changed MIG (sandbox.fakehw.mig)
        out["mig_mode"] = state.mig_mode
    if state.mig is not None:
        out["mig"] = [{"gi": g.gi, "profile": g.profile, "start": g.start, "ci": g.ci}
                      for g in state.mig]
    return out


def _mig_from_json(raw: object, where: str) -> tuple[GpuInstance, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ControlError(f"{where}.mig: expected a list of GPU instances")
    out = []
    for k, item in enumerate(raw):
        at = f"{where}.mig[{k}]"
        if not isinstance(item, dict) or set(item) != {"gi", "profile", "start", "ci"}:
            raise ControlError(f"{at}: expected an object with gi, profile, start, ci")
        if not all(isinstance(item[f], int) and not isinstance(item[f], bool) and
                   0 <= item[f] <= 63 for f in ("gi", "profile", "start")):
            raise ControlError(f"{at}: gi, profile and start must be integers 0..63")
        if not isinstance(item["ci"], bool):
            raise ControlError(f"{at}.ci: expected true or false")
        out.append(GpuInstance(item["gi"], item["profile"], item["start"], item["ci"]))
    if len({g.gi for g in out}) != len(out):
        raise ControlError(f"{where}.mig: a GPU instance id appears twice")
    return tuple(sorted(out))


def state_from_json(obj: object, where: str) -> DeviceState:
    if not isinstance(obj, dict):
        raise ControlError(f"{where}: expected an object")
    try:
        health = Health(obj.get("health", "healthy"))
        raw_reason = obj.get("reason")
        reason = Reason(raw_reason) if raw_reason is not None else None
    except ValueError as exc:
        raise ControlError(f"{where}: {exc}") from exc
    plugged = obj.get("plugged", True)
    num_vfs = obj.get("num_vfs")
    if not isinstance(plugged, bool):
        raise ControlError(f"{where}.plugged: expected true or false")
    if num_vfs is not None and (not isinstance(num_vfs, int) or isinstance(num_vfs, bool)):
        raise ControlError(f"{where}.num_vfs: expected an integer or null")
    raw_ports = obj.get("port_vfs", {})
    if not isinstance(raw_ports, dict):
        raise ControlError(f"{where}.port_vfs: expected an object of port -> count")
    ports: dict[int, int] = {}
    for key, n in raw_ports.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 3):
            raise ControlError(f"{where}.port_vfs: {key!r}: expected a port number")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ControlError(f"{where}.port_vfs.{key}: expected a non-negative integer")
        ports[int(key)] = n
    mig_mode = obj.get("mig_mode")
    if mig_mode is not None and not isinstance(mig_mode, bool):
        raise ControlError(f"{where}.mig_mode: expected true, false or null")
    return DeviceState(health=health, reason=reason, plugged=plugged, num_vfs=num_vfs,
                       port_vfs=tuple(sorted(ports.items())), mig_mode=mig_mode,
                       mig=_mig_from_json(obj.get("mig"), where))  # fmt: skip


def save_states(path: Path, states: Mapping[str, DeviceState]) -> None:
    """Write states atomically (temp file, rename): a killed server leaves old or new.

    No fsync: it costs 10-150 ms per change here, and a sandbox need not survive power
    loss; a crash of the server process is what this guards against. One writer per
    file (the server, under its lock), so the temp name is fixed."""
    doc = {
        "v": STATE_FILE_VERSION,
        "devices": {k: state_to_json(states[k]) for k in sorted(states)},
    }
    data = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def load_states(path: Path) -> dict[str, DeviceState]:
    """Read a state file written by ``save_states``; {} if there is none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ControlError(f"{path}: not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("v") != STATE_FILE_VERSION:
        raise ControlError(f"{path}: expected a version {STATE_FILE_VERSION} state file")
    devices = doc.get("devices")
    if not isinstance(devices, dict):
        raise ControlError(f"{path}: devices: expected an object")
    return {str(k): state_from_json(v, f"{path}: devices.{k}") for k, v in devices.items()}


def describe(records: Iterable[DeviceRecord]) -> list[dict[str, Any]]:
    """Devices as the control API's ``get`` reports them; a MIG-capable GPU also with its
    MIG mode and the GPU instances it holds now (the profile's, or as NVML left them)."""
    out = []
    for r in records:
        info: dict[str, Any] = {
            "id": r.id,
            "kind": r.kind,
            "vendor": r.vendor,
            "model": r.model,
            "pci_address": r.pci_address,
            "numa_node": r.numa_node,
            "dev_nodes": list(r.dev_nodes),
            "state": state_to_json(r.state),
        }
        if r.mig is not None:
            names = {p.id: p.name for p in r.mig.profiles}
            info["mig_mode"] = migrule.mode_of(r.mig, r.state)
            info["mig"] = [{"gi": g.gi, "profile": names.get(g.profile, str(g.profile)),
                            "start": g.start, "ci": g.ci}
                           for g in migrule.instances(r.mig, r.state)]
        out.append(info)
    return out
