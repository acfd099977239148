"""The kubelet harness as a server: a device manager on a device-plugins directory until
SIGTERM/SIGINT, restarted as a kubelet restart does on a signal (SIGHUP by default), with
a JSON status file of what it sees (the local runtime reads it for ``sandbox status``).

Its entry point is ``python -m sandbox.kubelet``; ``sandbox kubelet serve`` runs the same.
It prints ``supervisor.ready_line()`` once kubelet.sock listens and ``restarted`` after
each restart, once the status file says so. The status file's format and its reader and
writer are ``status``.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType

from sandbox import supervisor
from sandbox.errors import KubeletError
from sandbox.kubelet.devicemanager import DeviceManager
from sandbox.kubelet.resources import Snapshot
from sandbox.kubelet.status import write_status

RESTART_SIGNALS = ("SIGHUP", "SIGUSR1", "SIGUSR2")


def serve_harness(directory: Path, *, status_file: Path | None = None,
                  numa_nodes: int | None = None, restart_on: str | None = "SIGHUP") -> None:
    """Serve Registration on ``directory``/kubelet.sock until SIGTERM or SIGINT (this
    thread must be the main one). ``numa_nodes``: the node has NUMA nodes 0..N-1 (None:
    those the devices name). ``restart_on``: one of ``RESTART_SIGNALS``, or None."""
    numa = list(range(numa_nodes)) if numa_nodes is not None else None
    if numa is not None and not numa:
        raise KubeletError("--numa-nodes: expected at least 1")
    dm = DeviceManager(directory, numa_nodes=numa)
    stop = threading.Event()
    restarts: list[int] = []

    def on_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    def on_restart(signum: int, frame: FrameType | None) -> None:
        restarts.append(signum)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    if restart_on is not None:
        signal.signal(getattr(signal, restart_on), on_restart)
    dm.start()
    try:
        last: Snapshot | None = None
        print(supervisor.ready_line(), flush=True)
        while not stop.is_set():
            restarted = bool(restarts)
            if restarted:
                restarts.clear()
                dm.restart()
            snap = dm.snapshot()
            if status_file is not None and snap != last:
                write_status(status_file, snap, numa)
            last = snap
            if restarted:  # after the status file says so: callers wait for this line
                print("restarted", flush=True)
            stop.wait(0.1)
    finally:
        dm.stop()
