"""The one runner of short external commands (``mount``, ``ctr``, ``kind``, ``docker``...).

``run(argv)`` waits for the command and returns its ``Completed`` result; a command that
exits non-zero (unless ``check=False``), cannot be started or outlives ``timeout`` raises
``CommandError`` carrying the argv, the exit code and the output (kind's ``exec.RunError``
is the model). Long-running processes are not run here: ``sandbox.supervisor`` spawns
and watches those.

Standard library only (``python3 -m sandbox.images.rootfs`` runs before anything is
installed).
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from sandbox.errors import CommandError

SHORT = 120.0  # seconds: the default bound of a short command


@dataclass(frozen=True)
class Completed:
    """A command that ran to its end: its exit code and what it wrote."""

    argv: tuple[str, ...]
    returncode: int
    stdout_bytes: bytes
    stderr_bytes: bytes

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode(errors="replace")

    @property
    def output(self) -> str:
        """stdout then stderr, as ``CommandError.output`` carries them."""
        return self.stdout + self.stderr


def run(argv: Sequence[str], *, check: bool = True, step: str = "",
        input: str | bytes | None = None, stdin: IO[bytes] | None = None,
        env: Mapping[str, str] | None = None, timeout: float | None = SHORT,
        capture_stdout: bool = True) -> Completed:
    """Run ``argv`` to its end. ``input`` is written to its stdin (or ``stdin`` is given
    it); ``capture_stdout=False`` leaves stdout to this process's (stderr is always
    captured). ``step`` names what the command is for in the error. CommandError when it
    cannot be started, outlives ``timeout`` seconds (None: no bound) or, with ``check``,
    exits non-zero."""
    args = [str(a) for a in argv]
    data = input.encode() if isinstance(input, str) else input
    try:
        proc = subprocess.run(args, input=data, stdin=stdin if data is None else None,
                              stdout=subprocess.PIPE if capture_stdout else None,
                              stderr=subprocess.PIPE, env=env, timeout=timeout, check=False)
    except FileNotFoundError as exc:
        raise CommandError(args, None, "", step=step, problem=f"{args[0]} not found") from exc
    except subprocess.TimeoutExpired as exc:
        said = _text(exc.stdout) + _text(exc.stderr)
        raise CommandError(args, None, said, step=step,
                           problem=f"`{' '.join(args[:3])}` did not finish in "
                                   f"{timeout:.0f}s") from exc
    done = Completed(tuple(args), proc.returncode, proc.stdout or b"", proc.stderr or b"")
    if check and done.returncode != 0:
        raise CommandError(args, done.returncode, done.output, step=step)
    return done


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data
