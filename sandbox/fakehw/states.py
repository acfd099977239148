"""Device states on disk and in the control API: JSON (de)serialisation, the atomic
state file a server keeps across restarts, and the device list ``get`` reports."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sandbox.errors import ControlError
from sandbox.fakehw.tree import DeviceRecord, DeviceState, Health, Reason

STATE_FILE_VERSION = 1


def state_to_json(state: DeviceState) -> dict[str, Any]:
    out: dict[str, Any] = {
        "health": state.health.value,
        "reason": state.reason.value if state.reason else None,
        "plugged": state.plugged,
        "num_vfs": state.num_vfs,
    }
    if state.port_vfs:  # only once a port was set apart: older readers see what they knew
        out["port_vfs"] = {str(p): n for p, n in state.port_vfs}
    return out


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
    return DeviceState(health=health, reason=reason, plugged=plugged, num_vfs=num_vfs,
                       port_vfs=tuple(sorted(ports.items())))  # fmt: skip


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
    """Devices as the control API's ``get`` reports them."""
    return [
        {
            "id": r.id,
            "kind": r.kind,
            "vendor": r.vendor,
            "model": r.model,
            "pci_address": r.pci_address,
            "numa_node": r.numa_node,
            "dev_nodes": list(r.dev_nodes),
            "state": state_to_json(r.state),
        }
        for r in records
    ]
