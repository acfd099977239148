"""``check(plugin_cmd)``: run a device plugin against the harness and grade its behaviour.

The plugin command is started with the device-plugins directory in its arguments
(``{kubelet_dir}`` is replaced) and in the environment (``KUBELET_DEVICE_PLUGIN_DIR``,
and ``PLUGIN_SOCK_DIR`` as the Kubernetes sample plugin reads): the harness's own
(``WORKDIR/device-plugins``), or, for a plugin started through a ``prefix`` that shows
that directory elsewhere (``sandbox.kubelet.nodeview``: at the stock
/var/lib/kubelet/device-plugins), the ``plugin_dir`` it sees. Checks, in order:

    registers               a Register arrives
    serves-before-register  the endpoint accepted connections when Register arrived
    registration-accepted   version and resource name valid, dial-back and options succeed
    options                 GetDevicePluginOptions answers as the RegisterRequest said
    list-and-watch          a first device list arrives, health strings valid
    allocate                one device: Allocate (+ PreStartContainer when required)
    health-update           after ``fault(ids)`` makes one of the advertised devices
                            unhealthy, a new ListAndWatch message arrives
    restart                 after a kubelet restart, re-registered within ``restart_within``
    still-running           the plugin process survived all of it
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandbox import commands
from sandbox.errors import KubeletError, SandboxError
from sandbox.kubelet.devicemanager import HEALTHY, UNHEALTHY, DeviceManager, Event
from sandbox.supervisor import Child, signals_held

PASS, FAIL, NOT_RUN = "pass", "fail", "not-run"
DIR_NAME = "device-plugins"  # the harness's directory in the work dir


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str  # pass | fail | not-run
    message: str = ""
    seconds: float = 0.0  # how long the check took


@dataclass(frozen=True)
class FaultResult:
    """What a fault injector did: ``injected`` False says why it could not (the
    health-update check is then not run, with ``message`` as its reason)."""

    injected: bool
    message: str = ""


# The health-update check's fault injector: given the graded resource's healthy device ids
# as the plugin advertised them, it makes one of them unhealthy (or says why it cannot).
Fault = Callable[[Sequence[str]], FaultResult]


@dataclass(frozen=True)
class CheckReport:
    results: tuple[CheckResult, ...]
    events: tuple[Event, ...]
    plugin_output: str

    @property
    def passed(self) -> bool:
        return all(r.status != FAIL for r in self.results)

    def result(self, name: str) -> CheckResult:
        return next(r for r in self.results if r.name == name)

    def __str__(self) -> str:
        width = max(len(r.name) for r in self.results)
        lines = [f"{r.status.upper():<8} {r.name:<{width}}  {r.message}" for r in self.results]
        return "\n".join(lines)


class _Run:
    def __init__(self, dm: DeviceManager) -> None:
        self.dm = dm
        self.results: list[CheckResult] = []
        self.mark = time.monotonic()

    def add(self, name: str, ok: bool, message: str) -> bool:
        now = time.monotonic()
        self.results.append(CheckResult(name, PASS if ok else FAIL, message,
                                        round(now - self.mark, 3)))
        self.mark = now
        return ok

    def skip(self, names: Sequence[str], why: str) -> None:
        self.results += [CheckResult(n, NOT_RUN, why) for n in names]
        self.mark = time.monotonic()


def check(
    plugin_cmd: Sequence[str],
    *,
    workdir: Path | None = None,
    env: Mapping[str, str] | None = None,
    resource: str | None = None,
    fault: Fault | None = None,
    timeout: float = 10.0,
    restart_within: float = 5.0,
    dial_timeout: float = 3.0,
    prefix: Sequence[str] = (),
    plugin_dir: str | None = None,
) -> CheckReport:
    """Start ``plugin_cmd`` (after ``prefix``, e.g. a mount namespace's wrapper), put it
    through the checks above, stop it (and its process group), report. ``plugin_dir``:
    where the plugin sees the harness's directory (default: where it is)."""
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="dp-check-"))
    kubelet_dir = base / DIR_NAME
    seen = plugin_dir if plugin_dir is not None else str(kubelet_dir)
    dm = DeviceManager(kubelet_dir, dial_timeout=dial_timeout)
    argv = [*prefix, *(a.format(kubelet_dir=seen) for a in plugin_cmd)]
    proc_env = {
        **os.environ,
        "KUBELET_DEVICE_PLUGIN_DIR": seen,
        "PLUGIN_SOCK_DIR": seen.rstrip("/") + "/",
        **(env or {}),
    }
    log_path = base / "plugin.log"
    run = _Run(dm)
    log_path.unlink(missing_ok=True)
    proc: Child | None = None
    try:
        dm.start()
        with signals_held():  # started and known as one: a Ctrl-C cannot lose it
            proc = Child("plugin", argv, log_path, env=proc_env, group=True)
        _checks(run, proc, resource, fault, timeout, restart_within)
    finally:
        with signals_held():
            try:
                if proc is not None:
                    proc.stop()
            finally:
                dm.stop()
    return CheckReport(tuple(run.results), tuple(dm.events), log_path.read_text(errors="replace"))


def _checks(
    run: _Run,
    proc: Child,
    resource: str | None,
    fault: Fault | None,
    timeout: float,
    restart_within: float,
) -> None:
    dm = run.dm
    rest = [
        "serves-before-register",
        "registration-accepted",
        "options",
        "list-and-watch",
        "allocate",
        "health-update",
        "restart",
        "still-running",
    ]
    deadline = time.monotonic() + timeout
    registers: list[Event] = []
    while time.monotonic() < deadline and proc.returncode is None:
        registers = [
            e for e in dm.events_of("register") if resource is None or e.resource == resource
        ]
        if registers:
            break
        time.sleep(0.05)
    if not run.add(
        "registers",
        bool(registers),
        f"Register for {registers[0].resource} after {registers[0].time - dm.events[0].time:.2f}s"
        if registers
        else f"no Register within {timeout}s"
        + (f" (plugin exited with {proc.returncode})" if proc.returncode is not None else ""),
    ):
        run.skip(rest, "plugin never registered")
        return
    name = registers[0].resource
    # The dial-back outcome for the first Register is recorded right after it.
    first_dial = _wait_event(dm, name, ("dial", "dial-not-serving", "register-rejected"), timeout)
    run.add(
        "serves-before-register",
        first_dial is not None and first_dial.kind == "dial",
        "endpoint accepted connections when Register arrived"
        if first_dial and first_dial.kind == "dial"
        else f"endpoint {first_dial.detail if first_dial else '?'} was not serving when Register "
        "arrived; the kubelet dials back at once: serve first, then Register",
    )
    try:
        snap = dm.wait_registered(name, timeout)
    except KubeletError:
        rejects = [e.detail for e in dm.events_of("register-rejected", name)]
        run.add(
            "registration-accepted",
            False,
            "; ".join(rejects) or f"no ListAndWatch stream within {timeout}s",
        )
        run.skip(rest[2:], "registration did not complete")
        return
    run.add(
        "registration-accepted",
        True,
        f"{len(dm.events_of('register', name))} Register call(s) for {name}",
    )
    reg = dm.events_of("register", name)[-1].detail.rsplit("options=", 1)[-1]
    opts = dm.events_of("options", name)
    run.add(
        "options",
        bool(opts) and opts[-1].detail == reg,
        f"GetDevicePluginOptions -> {opts[-1].detail if opts else 'none'}; "
        f"RegisterRequest said {reg}",
    )
    state = snap.resources[name]
    bad = [d.id for d in state.devices if d.health not in (HEALTHY, UNHEALTHY)]
    run.add(
        "list-and-watch",
        not bad and state.capacity > 0,
        f"{state.capacity} devices, {state.allocatable} healthy"
        + (f"; invalid health on {bad}" if bad else "")
        + ("; empty device list" if state.capacity == 0 else ""),
    )
    try:
        alloc = dm.allocate(name, 1)
        specs_ok = all(os.path.isabs(c) and os.path.isabs(h) for c, h, _ in alloc.devices)
        pre_ok = alloc.pre_started or not state.options.get("pre_start_required")
        run.add(
            "allocate",
            specs_ok and pre_ok,
            f"{alloc.device_ids[0]}: {len(alloc.devices)} device specs, "
            f"{len(alloc.envs)} envs, cdi {list(alloc.cdi_devices)}"
            + ("" if specs_ok else "; device paths must be absolute"),
        )
        dm.release(alloc)
    except KubeletError as exc:
        run.add("allocate", False, str(exc))
    _health_update(run, name, fault, timeout)
    started = time.monotonic()
    dm.restart()
    try:
        dm.wait_registered(name, restart_within)
        run.add("restart", True, f"re-registered {time.monotonic() - started:.2f}s after restart")
    except KubeletError:
        run.add(
            "restart",
            False,
            f"not re-registered within {restart_within}s of a kubelet "
            "restart (watch your socket and kubelet.sock; register again)",
        )
    alive = proc.returncode is None
    run.add("still-running", alive, "running" if alive else f"exited with {proc.returncode}")


def check_program(program: str) -> None:
    """SandboxError, one line, when the plugin's program is not there to run."""
    if "/" in program:
        if not os.path.isfile(program):
            raise SandboxError(f"kubelet check: {program}: no such file")
        if not os.access(program, os.X_OK):
            raise SandboxError(f"kubelet check: {program}: not executable")
    elif shutil.which(program) is None:
        raise SandboxError(f"kubelet check: {program}: command not found")


def shell_fault(command: str, env: Mapping[str, str] | None = None) -> Fault:
    """``--fault``: a shell command (``env`` added to its environment) that makes a device
    unhealthy by itself; a non-zero exit is a SandboxError with what it said."""

    def fault(_advertised: Sequence[str]) -> FaultResult:
        result = commands.run(["sh", "-c", command], check=False, timeout=None,
                              env={**os.environ, **env} if env else None)
        if result.returncode != 0:
            raise SandboxError(f"--fault {command!r} failed (exit {result.returncode}): "
                               f"{result.stderr.strip()}")
        return FaultResult(True)

    return fault


def _health_update(run: _Run, name: str, fault: Fault | None, timeout: float) -> None:
    dm = run.dm
    if fault is None:
        run.skip(["health-update"], "no fault injector given (--fault, or --profile)")
        return
    state = dm.snapshot().resources.get(name)
    healthy = [d.id for d in state.devices if d.health == HEALTHY] if state else []
    before = len(dm.events_of("devices", name))
    started = time.monotonic()
    done = fault(healthy)
    if not done.injected:
        run.skip(["health-update"], done.message)
        return
    got = _wait_count(dm, "devices", name, before + 1, timeout)
    what = f"{done.message}: " if done.message else ""
    run.add(
        "health-update",
        got,
        f"{what}new device list {time.monotonic() - started:.2f}s after the fault, now "
        f"{dm.snapshot().allocatable(name)} healthy"
        if got
        else f"{what}no ListAndWatch update within {timeout}s of the fault",
    )


def _wait_event(
    dm: DeviceManager, resource: str, kinds: Sequence[str], timeout: float
) -> Event | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in list(dm.events):
            if e.resource == resource and e.kind in kinds:
                return e
        time.sleep(0.02)
    return None


def _wait_count(dm: DeviceManager, kind: str, resource: str, count: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(dm.events_of(kind, resource)) >= count:
            return True
        time.sleep(0.02)
    return False
