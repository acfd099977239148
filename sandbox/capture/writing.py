"""The commented YAML profile: ``Doc`` writes the document in the profile's own layout
(flow-style entries, a comment above each device with its real ids, hex ids as hex), and
``write_capture`` writes it to a file or stdout.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from sandbox.capture.devices import Entry, Hex, numa_ref
from sandbox.capture.reading import Function, Root
from sandbox.outfile import write_file
from sandbox.profile.model import API_VERSION, KIND


@dataclass(frozen=True)
class Capture:
    text: str  # the commented YAML profile
    profile: dict[str, Any]  # the document, camelCase keys as written
    left_out: tuple[str, ...]  # what the profile does not carry (also in the header)
    # "machine": every captured PCI function renders at its address on the machine (the
    # resolver's plan matched, or pciAddresses keep them); "planned": the machine's
    # addresses do not fit a profile and the resolver planned new ones.
    pci_addresses: str = "machine"



def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Hex):
        return f"0x{value.value:0{value.digits}x}"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if re.fullmatch(r"[A-Za-z][A-Za-z0-9 ()+._/-]*", text) and text.lower() not in {
            "yes", "no", "on", "off", "true", "false", "null", "y", "n", "~"} \
            and not text.endswith(" ") and ": " not in text:
        return text
    return json.dumps(text)



def _flow(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    return _scalar(value)



def plain(value: Any) -> Any:
    if isinstance(value, Hex):
        return value.value
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value



def sanitize_name(text: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].strip("-")
    return name or "captured"



@dataclass
class Doc:
    name: str
    node_name: str
    description: str
    cpu: dict[str, Any]
    numa_nodes: list[dict[str, Any]]
    distances: list[list[int]] | None
    host_bridges: list[dict[str, Any]] | None
    entries: list[Entry]
    with_addresses: bool
    extra: dict[str, Any] = field(default_factory=dict)  # swap, system
    root_complex: dict[str, Any] | None = None  # pci.rootComplex: 0000:00:00.0's own ids

    def device(self, e: Entry) -> dict[str, Any]:
        d = dict(e.fields)
        if e.count > 1:
            d = {**{k: v for k, v in d.items() if k in ("type", "vendor", "model")},
                 "count": e.count, **{k: v for k, v in d.items()
                                      if k not in ("type", "vendor", "model")}}
        if self.with_addresses:
            d["pciAddresses"] = list(e.addresses)
        return d

    def data(self) -> dict[str, Any]:
        numa: dict[str, Any] = {"nodes": self.numa_nodes}
        if self.distances is not None:
            numa["distances"] = self.distances
        node: dict[str, Any] = {"name": self.node_name, "cpu": self.cpu, **self.extra,
                                "numa": numa}
        pci: dict[str, Any] = {}
        if self.host_bridges is not None:
            pci["hostBridges"] = self.host_bridges
        if self.root_complex is not None:
            pci["rootComplex"] = self.root_complex
        if pci:
            node["pci"] = pci
        node["devices"] = [self.device(e) for e in self.entries]
        return {"apiVersion": API_VERSION, "kind": KIND,
                "metadata": {"name": self.name, "description": self.description},
                "nodes": [node]}

    def yaml(self, header: list[str]) -> str:
        lines = [f"# {h}" if h else "#" for h in header]
        lines += [f"apiVersion: {API_VERSION}", f"kind: {KIND}", "metadata:",
                  f"  name: {_scalar(self.name)}", f"  description: {_scalar(self.description)}",
                  "nodes:", f"  - name: {_scalar(self.node_name)}", "    cpu:"]
        lines += [f"      {k}: {_scalar(v)}" for k, v in self.cpu.items()]
        lines += [f"    {k}: {_flow(v)}" for k, v in self.extra.items()]
        lines += ["    numa:", "      nodes:"]
        lines += [f"        - {_flow(n)}" for n in self.numa_nodes]
        if self.distances is not None:
            lines.append("      distances:")
            lines += [f"        - {_flow(row)}" for row in self.distances]
        if self.host_bridges is not None or self.root_complex is not None:
            lines.append("    pci:")
        if self.host_bridges is not None:
            lines.append("      hostBridges:")
            lines += [f"        - {_flow(h)}" for h in self.host_bridges]
        if self.root_complex is not None:
            lines.append(f"      rootComplex: {_flow(self.root_complex)}")
        if not self.entries:
            lines.append("    devices: []")
        else:
            lines.append("    devices:")
            for e in self.entries:
                lines += [f"      # {c}" for c in e.comment.splitlines()]
                lines.append(f"      - {_flow(self.device(e))}")
        return "\n".join(lines) + "\n"



def host_bridges(root: Root, fns: list[Function], numa_nodes: list[dict[str, Any]]
                  ) -> list[dict[str, Any]] | None:
    """The machine's root buses (``sys/devices/pciDDDD:BB``) with their NUMA node: that of
    the functions below them (``none`` for -1, no affinity), else the node whose CPUs are
    the bus's ``cpulistaffinity``, else 0. None when they are the resolver's default (one
    per NUMA node, spread evenly)."""
    count = len(numa_nodes)
    below: dict[str, int] = {}  # root bus: the NUMA node of the first function below it
    for f in fns:
        if f.root_bus is not None and f.numa_raw < count:
            below.setdefault(f.root_bus, max(f.numa_raw, -1))
    found: dict[str, int] = {}
    for name in root.names("sys/devices", r"pci[0-9a-f]{4}:[0-9a-f]{2}"):
        if name in below:
            found[name] = below[name]
            continue
        bus = name[3:]
        cpus = root.line(f"sys/devices/{name}/pci_bus/{bus}/cpulistaffinity")
        found[name] = next((n["id"] for n in numa_nodes if cpus and n["cpus"] == cpus), 0)
    step = max(1, 256 // max(1, count))
    default = {f"pci0000:{n * step:02x}": n for n in range(count)}
    if not found or found == default:
        return None
    return [{"domain": Hex(int(name[3:7], 16), 4), "bus": Hex(int(name[8:10], 16), 2),
             "numaNode": numa_ref(numa)} for name, numa in sorted(found.items())]



def write_capture(result: Capture, path: str | os.PathLike[str], force: bool = False) -> None:
    """Write the profile to ``path`` ("-": stdout) through the one output writer
    (``sandbox.outfile``: a whole new regular file, an existing one only with ``force``,
    never through a link)."""
    if str(path) == "-":
        import sys

        sys.stdout.write(result.text)
        return
    write_file(path, result.text, force=force)
