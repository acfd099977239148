"""`sandbox kubeconfig`: the admin kubeconfig of a kind or native sandbox, printed, its
path printed, or copied to a file (as `kind get kubeconfig` / `kind export kubeconfig`)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from sandbox.errors import SandboxError
from sandbox.session import Session, find_session


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "kubeconfig",
        help="print a sandbox's kubeconfig (kind and native runtimes)",
        description="Print the admin kubeconfig of a kind or native sandbox, for kubectl "
        "and any Kubernetes client: `sandbox kubeconfig > k.yaml`, or `export "
        "KUBECONFIG=$(sandbox kubeconfig --path)`. The file lives in the sandbox's state "
        "directory and goes away with `sandbox down`; --write copies it. The local runtime "
        "has no API server, so no kubeconfig.",
    )
    p.add_argument("--name", help="which sandbox (default: the only one running)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--path", action="store_true",
                      help="print the file's path instead of its contents")
    what.add_argument("--write", metavar="FILE", type=Path,
                      help="copy it to FILE (mode 0600, replacing FILE) instead of printing")
    p.set_defaults(func=run)


def kubeconfig_of(session: Session) -> Path:
    """The sandbox's kubeconfig, or a SandboxError saying why there is none."""
    path = session.record.kubeconfig
    if not path:
        if session.runtime == "local":
            raise SandboxError(f"sandbox {session.name!r} runs the local runtime, which has no "
                               "Kubernetes API server and so no kubeconfig (the kind and "
                               "native runtimes have one)")
        raise SandboxError(f"sandbox {session.name!r} has no kubeconfig in its record")
    file = Path(path)
    if not file.is_file():
        raise SandboxError(f"{file}: the kubeconfig of sandbox {session.name!r} is missing")
    return file


def _write(dest: Path, text: str) -> None:
    """Replace ``dest`` in one step, readable by its owner only (it holds a client key)."""
    directory = dest.parent if str(dest.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run(args: argparse.Namespace) -> int:
    session = find_session(args.name)
    file = kubeconfig_of(session)
    if args.path:
        print(file)
        return 0
    text = file.read_text()
    if args.write is None:
        sys.stdout.write(text)
        return 0
    try:
        _write(args.write, text)
    except OSError as exc:
        raise SandboxError(f"{args.write}: cannot write: {exc.strerror}") from None
    print(f"wrote the kubeconfig of sandbox {session.name!r} to {args.write}", file=sys.stderr)
    return 0
