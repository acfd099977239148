"""The plugin's optional JSON config file: extra rules, ignored devices, PreStart options.

    {
      "rules": [{"vendor": "0x15b3", "class": "0x0207", "kind": "generic",
                 "resource": "example.com/hca"}],
      "ignore": ["0000:17:00.0"],
      "preStartRequired": ["nvidia.com/gpu"],      # or true for every resource
      "preferredAllocation": true
    }

Config rules are tried before the built-in ones, first match wins. JSON keeps the plugin
free of third-party parsers so its container needs only grpcio and protobuf.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hwplugins.deviceplugin.discovery import DEFAULT_RULES, KINDS, Rule


class ConfigError(Exception):
    """The config file cannot be read or has an invalid entry."""


@dataclass(frozen=True)
class Config:
    rules: tuple[Rule, ...] = DEFAULT_RULES
    ignore: tuple[str, ...] = ()
    pre_start_required: frozenset[str] | bool = False
    preferred_allocation: bool = True
    only: frozenset[str] = field(default_factory=frozenset)  # serve only these; empty = all

    def pre_start(self, resource: str) -> bool:
        if isinstance(self.pre_start_required, bool):
            return self.pre_start_required
        return resource in self.pre_start_required


def _rule(path: str, i: int, raw: object) -> Rule:
    where = f"{path}: rules[{i}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be an object")
    unknown = set(raw) - {"vendor", "class", "kind", "resource"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    kind = raw.get("kind", "generic")
    if kind not in KINDS:
        raise ConfigError(f"{where}.kind: {kind!r} is not one of {', '.join(KINDS)}")
    resource = raw.get("resource")
    if not isinstance(resource, str) or "/" not in resource:
        raise ConfigError(f"{where}.resource: need a domain-prefixed name like example.com/x")
    vendor = raw.get("vendor")
    try:
        vendor_id = int(vendor, 16) if isinstance(vendor, str) else None
    except ValueError as exc:
        raise ConfigError(f"{where}.vendor: {vendor!r} is not hex like 0x10de") from exc
    pci_class = raw.get("class", "")
    if not isinstance(pci_class, str):
        raise ConfigError(f"{where}.class: must be a hex string like 0x0302")
    return Rule(
        kind, resource, vendor=vendor_id, pci_class=pci_class, needs_physfn=kind == "sriov-vf"
    )


def load_config(path: Path | None) -> Config:
    if path is None:
        return Config()
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be an object")
    unknown = set(raw) - {"rules", "ignore", "preStartRequired", "preferredAllocation"}
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}")
    rules = tuple(_rule(str(path), i, r) for i, r in enumerate(raw.get("rules", [])))
    pre = raw.get("preStartRequired", False)
    if not isinstance(pre, bool | list):
        raise ConfigError(f"{path}: preStartRequired: must be true/false or a list of names")
    return Config(
        rules=rules + DEFAULT_RULES,
        ignore=tuple(str(a) for a in raw.get("ignore", [])),
        pre_start_required=pre if isinstance(pre, bool) else frozenset(map(str, pre)),
        preferred_allocation=bool(raw.get("preferredAllocation", True)),
    )
