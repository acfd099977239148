"""Run as PID 1 of a fresh pid namespace (``unshare --pid --fork --mount --mount-proc``):
bring a local sandbox up, kill its kubelet harness, hand the dead process's pid to an
unrelated ``sleep`` (via /proc/sys/kernel/ns_last_pid), then run ``status``,
``fault restart-kubelet`` and ``down``. Prints one JSON line of what happened; the test
(tests/runtimes/test_local_runtime.py) judges it. Everything dies with the namespace."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sandbox(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], cwd=ROOT, text=True,
                          capture_output=True, check=False, timeout=120)


def reap() -> None:
    """We are PID 1 here: orphans (the detached servers) are ours to reap."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def take_pid(pid: int) -> subprocess.Popen[bytes] | None:
    """A ``sleep`` that has exactly ``pid`` (other processes' threads may race us)."""
    for _ in range(200):
        Path("/proc/sys/kernel/ns_last_pid").write_text(f"{pid - 1}\n")
        proc = subprocess.Popen(["sleep", "300"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


def main() -> int:
    out: dict[str, object] = {}
    up = sandbox("up", "profiles/fpga-dfl.yaml")
    out["up"] = [up.returncode, up.stderr[-500:]]
    record = json.loads((Path(os.environ["HWSANDBOX_STATE_DIR"]) / "fpga-dfl" /
                         "sandbox.json").read_text())
    [node] = record["nodes"]
    kubelet = int(record["nodes"][node]["procs"]["kubelet"]["pid"])
    os.kill(kubelet, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{kubelet}").exists() and time.monotonic() < deadline:
        reap()
        time.sleep(0.02)
    stranger = take_pid(kubelet)
    out["reused"] = stranger is not None
    if stranger is None:
        print(json.dumps(out))
        return 0
    status = sandbox("status")
    out["status"] = [status.returncode, status.stdout + status.stderr]
    restart = sandbox("fault", "restart-kubelet", node)
    out["restart"] = [restart.returncode, restart.stderr]
    down = sandbox("down")
    out["down"] = [down.returncode, down.stderr]
    reap()
    out["stranger_alive"] = stranger.poll() is None
    stranger.kill()
    stranger.wait()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
