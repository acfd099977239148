"""Finding running sandboxes: their state dirs, records and per-node control sockets.

``up`` writes ``<state root>/<name>/sandbox.json``; every other verb finds a sandbox by
``--name``, or takes the only one there is.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from sandbox.errors import SandboxError
from sandbox.runtimes.base import default_state_root
from sandbox.runtimes.record import NodeRecord, SandboxRecord, check_name, read_record


@dataclass(frozen=True)
class Session:
    name: str
    state_dir: Path
    record: SandboxRecord

    @property
    def runtime(self) -> str:
        return self.record.runtime or "?"

    @property
    def nodes(self) -> Mapping[str, NodeRecord]:
        return self.record.nodes

    def socket(self, node: str) -> Path:
        info = self.nodes.get(node)
        if info is None:
            known = ", ".join(self.nodes) or "none"
            raise SandboxError(f"sandbox {self.name!r} has no node {node!r} (nodes: {known})")
        return Path(info.socket)

    def control(self, node: str) -> AbstractContextManager[Path]:
        """The node's control socket as this process reaches it, for the block's length:
        the recorded path, or a relay where the runtime reaches its nodes another way
        (``Runtime.reach``: kind's exec transport)."""
        from sandbox.runtimes import runtime_for

        socket = self.socket(node)
        return runtime_for(self.runtime).reach(self.state_dir, node, socket)


def list_sessions(root: Path | None = None) -> list[Session]:
    root = root or default_state_root()
    out = []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            record = read_record(d) if d.is_dir() else None
            if record is not None:
                out.append(Session(d.name, d, record))
    return out


def find_session(name: str | None, root: Path | None = None) -> Session:
    if name is not None:
        check_name(name)
    sessions = list_sessions(root)
    if name is not None:
        for s in sessions:
            if s.name == name:
                return s
        known = ", ".join(s.name for s in sessions) or "none running"
        raise SandboxError(f"no sandbox named {name!r} ({known}); start one with `sandbox up`")
    if not sessions:
        raise SandboxError("no sandbox is running; start one with `sandbox up PROFILE`")
    if len(sessions) > 1:
        names = ", ".join(s.name for s in sessions)
        raise SandboxError(f"several sandboxes are running ({names}); pick one with --name")
    return sessions[0]
