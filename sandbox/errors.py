"""Every exception the sandbox raises on purpose.

    SandboxError                 base; the CLI catches only this and prints ``error: ...``
    ├── ProfileError             one or more problems in a profile, each with file:line:col
    ├── SpecError                a resolved spec file (``sandbox.profile.spec.load``) is unusable
    ├── RenderError              a tree cannot be written where asked
    ├── MountError               a FUSE mount cannot be made, served or recovered
    ├── ControlError             the control API refused a request or cannot be reached
    ├── ScenarioError            a fault scenario is invalid (every problem) or a step failed
    ├── KubeletError             the kubelet harness cannot do what was asked
    │   └── AllocationError      an allocation failed, as the kubelet would fail the pod
    │       └── TopologyAffinityError  the TopologyManager policy rejected the request
    ├── CaptureError             a machine root cannot be captured, or its profile written
    ├── SpawnError               a process could not be started, or did not become ready
    ├── RuntimeBackendError      a runtime (local, native, kind) failed at a named step
    ├── RecordError              a sandbox record (``sandbox.json``) cannot be read
    ├── ImageBuildError          an image cannot be built from local files (says what to do)
    ├── NvmlBuildError           our NVML library cannot be built (no gcc, or gcc failed)
    └── CommandError             an external command failed (``sandbox.commands.run``):
                                 carries argv, exit code and output, like kind's RunError

Anything else escaping to the CLI is a bug and is allowed to crash loudly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class SandboxError(Exception):
    """Base of every error the sandbox reports to a user."""


@dataclass(frozen=True)
class Problem:
    """One problem found in a profile, located like a compiler message."""

    file: str
    line: int
    column: int
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.column}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class ProfileError(SandboxError):
    """A profile could not be loaded; ``problems`` lists every problem found."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class SpecError(SandboxError):
    """A serialised resolved spec is not one this version can load (names the field)."""


class RenderError(SandboxError):
    """A tree cannot be written to the requested place."""


class MountError(SandboxError):
    """A FUSE mount cannot be made, served or recovered."""


class ControlError(SandboxError):
    """The control API refused a request or could not be reached.

    ``code`` names the kind of refusal where a client maps it onto its own errors (our
    NVML turns MIG refusals into NVML's return codes): ``insufficient-resources``,
    ``invalid-argument``, ``not-supported``, ``not-found``, ``in-use``."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class ScenarioError(SandboxError):
    """A scenario file is invalid (``problems`` lists every problem) or a step failed."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class CaptureError(SandboxError):
    """The root cannot be captured (not a sysfs-like tree) or the output cannot be written."""


class SpawnError(SandboxError):
    """A process could not be started, or did not become ready."""


class KubeletError(SandboxError):
    """The kubelet harness cannot do what was asked."""


class AllocationError(KubeletError):
    """An allocation failed; the message is the kubelet's own wording where it has one."""


class TopologyAffinityError(AllocationError):
    """The TopologyManager policy found no acceptable NUMA affinity (pod admission fails)."""


class RuntimeBackendError(SandboxError):
    """A runtime backend failed; ``step`` names what it was doing."""

    def __init__(self, step: str, message: str) -> None:
        self.step = step
        self.message = message
        super().__init__(f"{step}: {message}")


class OptionRefused(SandboxError):
    """A runtime was made with an option it does not have; ``option`` is its keyword
    (``reference_plugin``, ``plugin_options``, ``feature_gates``, ...)."""

    def __init__(self, runtime: str, option: str) -> None:
        self.runtime = runtime
        self.option = option
        super().__init__(f"the {runtime} runtime has no option {option}")


class RecordError(SandboxError):
    """A sandbox record (``sandbox.json``) exists but cannot be read; names the file."""


class ImageBuildError(SandboxError):
    """A step of an image build failed; the message names the step and what to do."""


class NvmlBuildError(SandboxError):
    """Our libnvidia-ml.so.1 (sandbox.nvml) cannot be built; the message says how to fix it."""


def _gist(output: str) -> list[str]:
    """What a failed command's output says about its failure: its last three lines that
    start with "error" (any case; a Go program such as kind or kubeadm ends with a stack
    trace, its error lines above it), else its last five lines; each cut at 300
    characters."""
    lines = output.strip().splitlines()
    said = [line.strip() for line in lines if line.strip().lower().startswith("error")]
    return [line[:300] for line in (said[-3:] if said else lines[-5:])]


class CommandError(SandboxError):
    """An external command failed: it exited non-zero (``returncode``), or it could not be
    started or did not finish in time (``returncode`` None, ``problem`` says which).
    ``step`` (may be empty) names what the command was for; ``output`` is its stdout and
    stderr as captured."""

    def __init__(self, argv: Sequence[str], returncode: int | None, output: str, *,
                 step: str = "", problem: str = "") -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.output = output
        self.step = step
        self.problem = problem
        where = f"{step}: " if step else ""
        if returncode is None:
            super().__init__(f"{where}{problem}")
            return
        detail = "".join(f"\n  {line}" for line in _gist(output))
        super().__init__(f"{where}command {' '.join(self.argv)!r} exited {returncode}{detail}")
