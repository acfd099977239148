"""The driver config: what sysfs does not say about a GPU model (its memory, its partitions).

On real hardware NVML knows which MIG profiles a model supports; sysfs does not. The driver
takes that knowledge from a file (``--config``, JSON or YAML) keyed by PCI ``vendor:device``::

    apiVersion: hwsandbox.dev/v1alpha1
    kind: DraDriverConfig
    models:
      "10de:20b2":
        name: NVIDIA A100-SXM4-80GB
        memory: 85899345920            # bytes, or a quantity such as 80Gi
        partitions:
          memorySlices: 8
          computeSlices: 7
          modes: [mig]                 # more than one: compatibility groups (alpha)
          compatibilityGroups:         # optional, per mode (default: the mode's own name)
            mig: [mig]                 # at most 2 names; [] = no groups (see slices)
          profiles:
            - {name: 1g.10gb, memorySlices: 1, computeSlices: 1, memory: 10Gi}

``config_from_devices`` writes that document from plain data (``sandbox dra config`` feeds
it a profile's devices), so the driver never imports the sandbox.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

API_VERSION = "hwsandbox.dev/v1alpha1"
KIND = "DraDriverConfig"
_GROUP = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # the API's k8s-short-name
_PCI_ID = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{4}$")
_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_FACTORS = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
            "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}  # fmt: skip


class ConfigError(Exception):
    """A driver config that cannot be used; the message lists every problem, one a line."""


@dataclass(frozen=True)
class PartitionProfile:
    name: str
    memory_slices: int
    compute_slices: int
    memory: int  # bytes

    def instances(self, memory_slices: int, compute_slices: int) -> int:
        """How many of this profile fit on one GPU at most."""
        return min(memory_slices // self.memory_slices, compute_slices // self.compute_slices)


@dataclass(frozen=True)
class Partitioning:
    memory_slices: int
    compute_slices: int
    modes: tuple[str, ...]
    profiles: tuple[PartitionProfile, ...]
    groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def compatibility_groups(self, mode: str) -> tuple[str, ...]:
        """The groups of ``mode``'s partitions: configured, else the mode's own name."""
        return self.groups.get(mode, (mode,))


@dataclass(frozen=True)
class ModelConfig:
    name: str = ""
    memory: int | None = None
    partitions: Partitioning | None = None


@dataclass(frozen=True)
class DriverConfig:
    models: Mapping[str, ModelConfig]

    def model(self, pci_id: str) -> ModelConfig:
        return self.models.get(pci_id, ModelConfig())


EMPTY = DriverConfig({})


def parse_quantity(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _QUANTITY.match(str(value))
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    return int(m.group(1)) * _FACTORS[m.group(2)]


def _int(data: Mapping[str, Any], key: str, where: str, problems: list[str]) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        problems.append(f"{where}.{key}: want a positive integer, got {value!r}")
        return 1
    return value


def _partitions(data: Any, where: str, problems: list[str]) -> Partitioning | None:
    if data is None:
        return None
    if not isinstance(data, Mapping):
        problems.append(f"{where}: want a mapping")
        return None
    ms = _int(data, "memorySlices", where, problems)
    cs = _int(data, "computeSlices", where, problems)
    modes = data.get("modes", ["mig"])
    if not isinstance(modes, list) or not modes or not all(isinstance(m, str) for m in modes):
        problems.append(f"{where}.modes: want a non-empty list of names")
        modes = ["mig"]
    groups: dict[str, tuple[str, ...]] = {}
    raw_groups = data.get("compatibilityGroups") or {}
    if not isinstance(raw_groups, Mapping):
        problems.append(f"{where}.compatibilityGroups: want a mapping of mode to names")
        raw_groups = {}
    for mode, names in raw_groups.items():
        at = f"{where}.compatibilityGroups[{mode!r}]"
        if mode not in modes:
            problems.append(f"{at}: not one of the modes {modes}")
        elif (not isinstance(names, list) or len(names) > 2 or len(set(names)) != len(names)
              or not all(isinstance(n, str) and _GROUP.match(n) for n in names)):  # fmt: skip
            problems.append(f"{at}: want at most 2 distinct names (DNS labels), got {names!r}")
        else:
            groups[mode] = tuple(names)
    profiles = []
    for i, p in enumerate(data.get("profiles") or []):
        at = f"{where}.profiles[{i}]"
        if not isinstance(p, Mapping) or not isinstance(p.get("name"), str):
            problems.append(f"{at}: want a mapping with a name")
            continue
        pms, pcs = _int(p, "memorySlices", at, problems), _int(p, "computeSlices", at, problems)
        if pms > ms or pcs > cs:
            problems.append(f"{at}: {p['name']} needs more slices than the GPU has")
        try:
            memory = parse_quantity(p.get("memory", 0))
        except ValueError as exc:
            problems.append(f"{at}.memory: {exc}")
            memory = 0
        profiles.append(PartitionProfile(p["name"], pms, pcs, memory))
    return Partitioning(ms, cs, tuple(modes), tuple(profiles), groups)


def parse_config(data: Any, source: str = "config") -> DriverConfig:
    if data is None:
        return EMPTY
    problems: list[str] = []
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: want a mapping at the top")
    if data.get("kind", KIND) != KIND:
        problems.append(f"kind: want {KIND}, got {data.get('kind')!r}")
    models: dict[str, ModelConfig] = {}
    for key, entry in (data.get("models") or {}).items():
        where = f"models[{key!r}]"
        pci_id = str(key).lower()
        if not _PCI_ID.match(pci_id):
            problems.append(f"{where}: key must be PCI vendor:device in hex, e.g. 10de:20b2")
            continue
        if not isinstance(entry, Mapping):
            problems.append(f"{where}: want a mapping")
            continue
        memory = None
        if entry.get("memory") is not None:
            try:
                memory = parse_quantity(entry["memory"])
            except ValueError as exc:
                problems.append(f"{where}.memory: {exc}")
        partitions = _partitions(entry.get("partitions"), f"{where}.partitions", problems)
        if partitions is not None and memory is None:
            problems.append(f"{where}: partitions need the GPU's memory")
        models[pci_id] = ModelConfig(str(entry.get("name", "")), memory, partitions)
    if problems:
        raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
    return DriverConfig(models)


def load_config(path: Path | str | None) -> DriverConfig:
    """``path`` as JSON (``.json``) or YAML; ``None`` means no models are known."""
    if path is None:
        return EMPTY
    try:
        text = Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return parse_config(data, str(path))


def config_from_devices(devices: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The config document for ``devices``: mappings with ``vendorID`` and ``deviceID``
    (ints), ``name``, ``memory`` (bytes or None) and ``partitions`` (None, or a mapping
    with ``memorySlices``, ``computeSlices``, ``modes``, ``profiles``: [{``name``,
    ``memorySlices``, ``computeSlices``, ``memory``}]). Raises ``ConfigError`` when two
    devices with one PCI id disagree (the driver could not tell them apart)."""
    models: dict[str, dict[str, Any]] = {}
    for dev in devices:
        pci_id = f"{int(dev['vendorID']):04x}:{int(dev['deviceID']):04x}"
        entry: dict[str, Any] = {"name": dev.get("name", "")}
        if dev.get("memory") is not None:
            entry["memory"] = int(dev["memory"])
        if dev.get("partitions"):
            p = dev["partitions"]
            entry["partitions"] = {
                "memorySlices": int(p["memorySlices"]),
                "computeSlices": int(p["computeSlices"]),
                "modes": list(p.get("modes") or ["mig"]),
                **({"compatibilityGroups": {k: list(v) for k, v in
                                            p["compatibilityGroups"].items()}}
                   if p.get("compatibilityGroups") else {}),
                "profiles": [
                    {"name": q["name"], "memorySlices": int(q["memorySlices"]),
                     "computeSlices": int(q["computeSlices"]), "memory": int(q["memory"])}
                    for q in p.get("profiles", [])
                ],
            }  # fmt: skip
        if pci_id in models and models[pci_id] != entry:
            raise ConfigError(f"devices with PCI id {pci_id} disagree: "
                              f"{models[pci_id]} vs {entry}")  # fmt: skip
        models[pci_id] = entry
    return {"apiVersion": API_VERSION, "kind": KIND, "models": models}
