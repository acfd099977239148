"""The oci-cpumap runtime wrapper: installing it, and its mapping rule.

With the static CPU manager and Static memory manager, containerd asks runc for the emulated
cpusets (``cpus: "1-31,33-63"``, ``mems: "1"``) and the host's kernel refuses them. The
POSIX sh + jq script ``oci-cpumap`` next to this module sits in front of runc (containerd's
``BinaryName``) and rewrites them to the host's ids; it is a shell script because kind node
images have no python3. This module owns writing that script with the real runc baked in
(``install``; ``script_text`` for runtimes that write files into a node themselves) and
``map_cpulist``, the same rule in Python, which the tests use as their oracle. Design:
docs/kubelet-topology-notes.md, section 4 (a).

The same wrapper keeps device numbers honest (``sandbox.fakehw.devnodes``' rule, enforced
where every container is made): a device entry whose numbers the node does not have at
that path (a CDI spec's explicit MIG numbers, for one) becomes a char 1:3 stand-in, with the
cgroup rules that allowed it (tests/runtimes/test_oci_devices.py).
"""

from __future__ import annotations

import os
import shlex
import tempfile
from pathlib import Path

from sandbox.errors import SandboxError

SCRIPT = Path(__file__).with_name("oci-cpumap")
PLACEHOLDER = "REAL_RUNC=@REAL_RUNC@"
NETNS_PLACEHOLDER = "PLUGINS_NETNS=@PLUGINS_NETNS@"
MAX_ID = 65535


def script_text(real_runc: str, plugins_netns: str = "") -> str:
    """The wrapper script with ``real_runc`` (an absolute path) as the runtime it execs and
    ``plugins_netns`` (an absolute nsfs path, or empty: none) as the network namespace
    annotated hostNetwork containers join."""
    lines = SCRIPT.read_text().splitlines(keepends=True)
    for placeholder, name, value, what in (
            (PLACEHOLDER, "REAL_RUNC", real_runc, "the real runc"),
            (NETNS_PLACEHOLDER, "PLUGINS_NETNS", plugins_netns, "the plugins' netns")):
        if (value or name == "REAL_RUNC") and (
                not value.startswith("/") or any(ord(c) < 32 or ord(c) == 127 for c in value)):
            raise SandboxError(f"oci-cpumap: {what} must be an absolute path, got {value!r}")
        at = [i for i, line in enumerate(lines) if line.rstrip("\n") == placeholder]
        if len(at) != 1:
            raise SandboxError(f"{SCRIPT}: expected one line {placeholder!r}, found {len(at)}")
        lines[at[0]] = f"{name}={shlex.quote(value)}\n"
    return "".join(lines)


def install(dest: Path, real_runc: str, plugins_netns: str = "") -> Path:
    """Write the wrapper to ``dest`` (mode 0755, atomically) to exec ``real_runc``
    (``plugins_netns``: see ``script_text``)."""
    text = script_text(real_runc, plugins_netns)
    try:
        missing = [p for p in (dest.parent, *dest.parent.parents) if not p.exists()]
        for directory in reversed(missing):
            directory.mkdir(mode=0o755, exist_ok=True)
            directory.chmod(0o755)  # mkdir's mode is filtered by the umask
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o755)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise SandboxError(f"cannot install oci-cpumap at {dest}: {exc}") from exc
    return dest


def _ids(cpulist: str) -> set[int]:
    ids: set[int] = set()
    for part in cpulist.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if last > MAX_ID:
            raise SandboxError(f"cpulist {cpulist!r}: id {last} is above {MAX_ID}")
        ids.update(range(first, last + 1))
    return ids


def map_cpulist(ids: str, allowed: str) -> str:
    """``ids`` unchanged if all allowed, else each id e as ``allowed[e % len(allowed)]``."""
    want, have = _ids(ids), sorted(_ids(allowed))
    if want <= set(have):
        return ids
    mapped = sorted({have[e % len(have)] for e in want})
    runs: list[list[int]] = []
    for i in mapped:
        if runs and runs[-1][1] + 1 == i:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
