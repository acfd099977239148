"""``python -m sandbox.kubelet --dir DIR``: the kubelet harness's entry point (what the
local runtime starts; ``sandbox.kubelet.harness``). Errors are ``error: ...`` lines on
stderr and exit 1."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    from sandbox.kubelet.harness import RESTART_SIGNALS

    p = argparse.ArgumentParser(prog="python -m sandbox.kubelet",
                                description="Serve Registration on DIR/kubelet.sock until "
                                "SIGTERM or SIGINT (see `sandbox kubelet serve`).")
    p.add_argument("--dir", type=Path, required=True, help="device-plugins directory")
    p.add_argument("--status-file", type=Path, help="keep this JSON status file up to date")
    p.add_argument("--numa-nodes", type=int, metavar="N", help="NUMA nodes 0..N-1")
    p.add_argument("--restart-on", choices=(*RESTART_SIGNALS, "none"), default="SIGHUP",
                   help="signal that restarts the kubelet (default SIGHUP)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC core's own INFO lines are not ours to print (as the CLI: sandbox.cli)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from sandbox.errors import SandboxError
    from sandbox.kubelet.harness import serve_harness

    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        serve_harness(args.dir, status_file=args.status_file, numa_nodes=args.numa_nodes,
                      restart_on=None if args.restart_on == "none" else args.restart_on)
    except SandboxError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"error: {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
