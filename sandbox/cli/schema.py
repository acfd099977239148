"""`sandbox schema`: print the profile's JSON Schema (for editors and CI linting)."""

from __future__ import annotations

import argparse
import sys

from sandbox.profile.schema import schema_text


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "schema",
        help="print the profile JSON Schema",
        description="Print the JSON Schema of HardwareProfile documents. Point your editor's "
        "YAML language server at it, e.g. `sandbox schema > profile.schema.json`.",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(schema_text())
    return 0
