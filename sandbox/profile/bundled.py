"""The profiles that ship with the sandbox, found by name: ``sandbox up 8gpu-2numa``.

In a checkout they are the files of ``profiles/``; an installed sandbox (a wheel) carries
the same files as the package data ``sandbox.data.profiles``. A profile argument is, in
this order: ``-`` (standard input), a file that exists, or the name of a bundled profile
(with or without ``.yaml``, never a path with a ``/``).
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path

STDIN = "-"
PROFILE_HELP = ("a profile file, the name of a bundled profile (`sandbox profiles` lists "
                "them) or - for standard input")


def _files() -> list[Path]:
    """The bundled profile files: the checkout's ``profiles/``, else the installed package
    data (plain files where setuptools installs it; ``sandbox.data`` is a namespace, so
    ``files()`` may join several directories)."""
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file() and (repo / "profiles").is_dir():
        return sorted((repo / "profiles").glob("*.yaml"))
    try:
        entries = list(resources.files("sandbox.data.profiles").iterdir())
    except (ModuleNotFoundError, OSError):
        return []
    return sorted(Path(str(e)) for e in entries if e.name.endswith(".yaml"))


def bundled() -> dict[str, Path]:
    """Name -> file of every bundled profile, sorted by name (the first of a name wins)."""
    out: dict[str, Path] = {}
    for p in _files():
        if p.is_file():
            out.setdefault(p.stem, p)
    return dict(sorted(out.items()))


def locate(arg: str) -> str:
    """The file a profile argument names (see the module's docstring); an argument that
    names nothing is returned as it is, for the reader to report."""
    if arg == STDIN or Path(arg).exists() or "/" in arg:
        return arg
    found = bundled().get(arg.removesuffix(".yaml"))
    return str(found) if found is not None else arg


def did_you_mean(arg: str) -> str:
    """`` (did you mean X?)`` for a profile argument that names nothing: the closest
    bundled name, or the closest file beside the one named; empty when nothing is close."""
    path = Path(arg)
    stem = path.name.removesuffix(".yaml")
    names = list(bundled())
    close = difflib.get_close_matches(stem, names, n=1, cutoff=0.75)
    if close and "/" not in arg:
        return f" (did you mean {close[0]!r}? `sandbox profiles` lists the bundled ones)"
    try:
        siblings = [p.name for p in path.parent.iterdir() if p.suffix in (".yaml", ".yml")]
    except OSError:
        siblings = []
    near = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.75)
    if near:
        return f" (did you mean {str(path.parent / near[0])!r}?)"
    if close:
        return f" (did you mean the bundled profile {close[0]!r}?)"
    return ""
