"""Start a Python program ahead of time: import it now, run it once a file appears.

    python -m sandbox.prestart GO_FILE SECONDS MODULE [ARG...]

imports ``MODULE.__main__`` (the interpreter's start and the program's imports: for our
device plugin, grpc and protobuf, ~0.15 s on a 2-core machine), waits until ``GO_FILE``
exists, then runs the module as ``python -m MODULE ARG...`` would, in this process (same
pid, same log). The local runtime starts each node's device plugin this way beside the
mount server, and creates ``GO_FILE`` once the tree is served: the plugin's start-up is
paid while the tree is built, not after. Without ``GO_FILE`` within ``SECONDS`` it exits
with status 3, running nothing.

Imports nothing of the sandbox: only the program it starts.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
import time

POLL = 0.005  # seconds between looks for GO_FILE
NOT_STARTED = 3


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: python -m sandbox.prestart GO_FILE SECONDS MODULE [ARG...]",
              file=sys.stderr)  # fmt: skip
        return 2
    go, seconds, module, args = argv[0], float(argv[1]), argv[2], argv[3:]
    main_module = f"{module}.__main__"
    importlib.import_module(main_module)  # its __name__ guard keeps it from running
    del sys.modules[main_module]  # run_module runs a fresh copy; what it imported stays
    deadline = time.monotonic() + seconds
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            print(f"prestart: {go} did not appear within {seconds:g} s; not starting "
                  f"{module}", file=sys.stderr)  # fmt: skip
            return NOT_STARTED
        time.sleep(POLL)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
