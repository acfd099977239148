"""Run as PID 1 of a fresh pid namespace (``unshare --pid --fork --mount-proc``) with a
state dir to create: record the native runtime's processes exactly as its ``up`` does
(``native.common.spawn``: ``sandbox.supervisor.spawn``, pid + start time saved in
``run/NAME.pid``), kill them all, hand every dead pid to an unrelated ``sleep`` (via
/proc/sys/kernel/ns_last_pid), then run the native runtime's ``status``,
``restart_kubelet`` and the process half of its ``down`` (``undo_steps(down_steps())``;
the host clean-up that follows touches only host-wide state, never a pid). A small HTTP
server stands in for the API server (404: no such node) and the kubelet's healthz.
Prints one JSON line of what happened; tests/runtimes/test_supervisor_pid_reuse.py judges it.
Everything dies with the namespace."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# the local runtime's probe, beside this file (sys.path[0] when run as a script): PID 1's
# reaping and handing a pid on (the HTTP server's threads fork nothing to race it)
from pid_reuse_probe import reap, take_pid

from sandbox import supervisor
from sandbox.errors import SandboxError
from sandbox.runtimes.native import NativeRuntime
from sandbox.runtimes.native.common import EXTRAS, ORDER, Layout, running, spawn
from sandbox.runtimes.native.steps import down_steps
from sandbox.runtimes.record import NodeRecord, SandboxRecord, write_record
from sandbox.runtimes.steps import undo_steps
from sandbox.supervisor import Proc

NODE = "pid-reuse-node"


class _Fake(BaseHTTPRequestHandler):
    """``/healthz``: ok (the kubelet); anything else: 404 (the API server knows no node)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/healthz":
            body, code = b"ok", 200
        else:
            body, code = json.dumps({"kind": "Status", "apiVersion": "v1", "code": 404,
                                     "status": "Failure", "reason": "NotFound"}).encode(), 404
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        return None


def main() -> int:
    state = Path(sys.argv[1])
    layout = Layout(state)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    write_record(state, SandboxRecord(
        runtime="native", cluster="pid-reuse", name=state.name,
        # the node's entry as `up` writes it; no fake hardware server
        # answers at its socket (status notes that, and goes on)
        nodes={NODE: NodeRecord(root=str(state / "node-root"),
                                socket=str(state / "node" / "control.sock"))},
        ports={"kubelet-healthz": server.server_address[1]}))
    layout.kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": url}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    runtime = NativeRuntime()
    names = (*ORDER, *EXTRAS)
    out: dict[str, object] = {}
    procs = {n: spawn(layout, n, ["sleep", "300"]) for n in names}
    out["ours_before"] = {n: running(layout, n) is not None for n in names}
    out["notes_before"] = runtime.status(state).nodes[0].notes
    for p in procs.values():
        os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p.pid}").exists() for p in procs.values()):
        if time.monotonic() > deadline:
            out["not_dead"] = True
            print(json.dumps(out))
            return 0
        reap()
        time.sleep(0.02)
    taken = {n: take_pid(p.pid) for n, p in procs.items()}
    out["reused"] = {n: s is not None for n, s in taken.items()}
    strangers = {n: s for n, s in taken.items() if s is not None}
    if len(strangers) < len(taken):
        print(json.dumps(out))
        return 0
    out["same_process"] = {n: supervisor.same_process(p.pid, p.start) for n, p in procs.items()}
    out["loaded_running"] = {n: rec.running() for n in names
                             if (rec := Proc.load(layout.run / f"{n}.pid")) is not None}
    out["running"] = {n: running(layout, n) is not None for n in names}
    out["notes"] = runtime.status(state).nodes[0].notes
    try:
        runtime.restart_kubelet(state, NODE)
        out["restart"] = "ok"
    except SandboxError as exc:
        out["restart"] = f"error: {exc}"
    new = Proc.load(layout.run / "kubelet.pid")
    out["new_kubelet"] = (None if new is None else
                          {"pid": new.pid, "old_pid": procs["kubelet"].pid,
                           "running": new.running()})
    out["alive_after_restart"] = {n: s.poll() is None for n, s in strangers.items()}
    down_notes: list[str] = []
    out["down_problems"] = undo_steps(down_steps(layout, down_notes.append), down_notes.append)
    out["down_notes"] = down_notes
    reap()
    out["new_kubelet_stopped"] = new is not None and not new.running()
    out["pid_files_left"] = sorted(p.name for p in layout.run.glob("*.pid"))
    out["stranger_alive"] = {n: s.poll() is None for n, s in strangers.items()}
    for s in strangers.values():
        s.kill()
        s.wait()
    server.shutdown()
    server.server_close()
    # no API server answers now: status says so instead of raising (urllib3's MaxRetryError)
    out["notes_no_api"] = runtime.status(state).nodes[0].notes
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
