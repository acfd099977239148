"""The CDI specs for the names Allocate answers with (``Device.cdi_name``, such as
``hwsandbox.dev/gpu=gpu3``): one file per CDI kind in a directory the container runtime
reads (containerd 2.x: ``/etc/cdi``, ``/var/run/cdi``), so a runtime with CDI can resolve
every name. Each device's edits are its device nodes, host path = container path, as
Allocate's DeviceSpecs (the node's own /dev, where the sandbox makes a stand-in for each
fake node). Written when the devices change, atomically; removed when the plugin stops.
CDI spec format: github.com/cncf-tags/container-device-interface SPEC.md (v0.6.0).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from hwplugins.deviceplugin.discovery import Device

log = logging.getLogger("hwplugins.deviceplugin")

PREFIX = "hwsandbox-deviceplugin-"


def specs(devices: Iterable[Device]) -> dict[str, str]:
    """File name -> spec text, one per CDI kind among ``devices``."""
    kinds: dict[str, dict[str, list[dict[str, object]]]] = {}
    for dev in devices:
        if not dev.cdi_name or not dev.dev_nodes:
            continue
        kind, _, name = dev.cdi_name.partition("=")
        entries = kinds.setdefault(kind, {})
        entries.setdefault(name, [{"path": p} for p in dev.dev_nodes])
    return {f"{PREFIX}{kind.replace('/', '-')}.json": json.dumps({
        "cdiVersion": "0.6.0", "kind": kind,
        "devices": [{"name": n, "containerEdits": {"deviceNodes": nodes}}
                    for n, nodes in sorted(entries.items())]}, indent=2) + "\n"
        for kind, entries in sorted(kinds.items())}


class SpecDir:
    """Keeps ``directory``'s spec files equal to ``specs`` of the devices last given."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._written: dict[str, str] = {}

    def update(self, devices: Iterable[Device]) -> None:
        want = specs(devices)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for name, text in want.items():
                if self._written.get(name) != text:
                    tmp = self.directory / f".{name}.tmp"
                    tmp.write_text(text)
                    os.replace(tmp, self.directory / name)
            for name in self._written.keys() - want.keys():
                (self.directory / name).unlink(missing_ok=True)
        except OSError as exc:
            log.error("CDI specs in %s: %s", self.directory, exc)
            return
        if want.keys() != self._written.keys():
            log.info("CDI specs in %s: %s", self.directory, ", ".join(sorted(want)) or "none")
        self._written = want

    def close(self) -> None:
        for name in self._written:
            (self.directory / name).unlink(missing_ok=True)
        self._written = {}
