"""Fault scenarios in time: expanding a ``Scenario`` into actions and running them.

``expand`` turns a scenario into a flat, time-sorted list of ``Action``s (pure: a storm
is drawn from ``random.Random`` seeded by the scenario seed and the step number, so the
same file always gives the same changes). ``run_scenario`` performs the actions through a
``ControlClient`` at their times and returns the ``expect`` checks for the caller to
assert on: a device's state as the node's control server reports it (``Check``) or, with
a ``pod_health`` callable, what a pod's status says of a device (``PodCheck``; this layer
does not talk to Kubernetes itself: ``sandbox.podhealth.PodHealthLookup`` does).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sandbox.errors import ControlError, ScenarioError
from sandbox.fakehw.changes import Change, Op
from sandbox.fakehw.control.scenario.parse import PodExpect, Scenario
from sandbox.fakehw.tree import Health, Reason
from sandbox.profile.catalogue import fault_reasons

STORM_OPS_DEFAULT: tuple[Op, ...] = ("health", "unplug", "plug")
STORM_HEALTH = (
    (Health.HEALTHY, None),
    (Health.UNHEALTHY, Reason.AER_FATAL),
    (Health.UNHEALTHY, Reason.LINK_DOWN),
    (Health.UNHEALTHY, Reason.PORT_DOWN),
)


@dataclass(frozen=True)
class Action:
    """One thing to do at ``at`` seconds: a change, then optionally a check."""

    at: float
    step: int
    change: Change | None
    expect: Mapping[str, Mapping[str, Any]] | None = None
    pod_expect: PodExpect | None = None


@dataclass(frozen=True)
class Check:
    at: float
    step: int
    device: str
    expected: Mapping[str, Any]
    actual: Mapping[str, Any] | None

    @property
    def ok(self) -> bool:
        return self.actual is not None and all(
            self.actual.get(k) == v for k, v in self.expected.items()
        )

    def __str__(self) -> str:
        got = "no such device" if self.actual is None else _fields(self.actual)
        verdict = "ok" if self.ok else f"FAILED, got {got}"
        return f"steps[{self.step}] at {self.at:g}s: {self.device} {_fields(self.expected)}: " \
            f"{verdict}"


def _fields(state: Mapping[str, Any]) -> str:
    """``health unhealthy, reason aer-fatal, plugged true``: a state as the scenario file
    spells it (YAML's true/false/null), not as a Python dict."""
    def word(v: Any) -> str:
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    return ", ".join(f"{k} {word(v)}" for k, v in state.items())


@dataclass(frozen=True)
class PodCheck:
    """An ``expect: {pod: ..., device: ..., health: ...}``: ``seen`` are the (resource id,
    health) entries of the pod's status that match the device. Ok when there is one and
    every one has the expected health."""

    at: float
    step: int
    expected: PodExpect
    seen: tuple[tuple[str, str], ...]

    @property
    def device(self) -> str:
        return self.expected.device

    @property
    def ok(self) -> bool:
        return bool(self.seen) and all(h == self.expected.health for _, h in self.seen)

    def __str__(self) -> str:
        if self.ok:
            verdict = "ok"
        elif not self.seen:
            verdict = f"FAILED, no allocated device {self.expected.device} in its status"
        else:
            got = sorted({h for _, h in self.seen})
            detail = "" if len(self.seen) == 1 else " (" + ", ".join(
                f"{rid}: {h}" for rid, h in self.seen) + ")"
            verdict = f"FAILED, got {', '.join(got)}{detail}"
        return f"steps[{self.step}] at {self.at:g}s: {self.expected}: {verdict}"


PodHealth = Callable[[str, str, str, str | None], list[tuple[str, str]]]
"""(namespace, pod, device, container or None) -> the (resource id, health) entries of
the pod's status that match ``device`` (the profile's id, or a resource id itself)."""


@dataclass
class ScenarioResult:
    applied: list[tuple[Action, dict[str, Any]]] = field(default_factory=list)
    checks: list[Check | PodCheck] = field(default_factory=list)

    @property
    def failures(self) -> list[Check | PodCheck]:
        return [c for c in self.checks if not c.ok]

    @property
    def ok(self) -> bool:
        return not self.failures


class Client(Protocol):
    """What the runner needs from a ``ControlClient``."""

    def request(self, op: str, **fields: Any) -> dict[str, Any]: ...

    def devices(self) -> dict[str, dict[str, Any]]: ...



# -- expanding ----------------------------------------------------------------------------
def _change(op: str, args: Mapping[str, Any]) -> Change:
    if op == "health":
        h = Health(args["health"])
        r = Reason(args["reason"]) if args.get("reason") is not None else None
        return Change("health", args["device"], health=h, reason=r)
    if op == "set-vfs":
        return Change("set-vfs", args["device"], num_vfs=args["num_vfs"], port=args.get("port"))
    if op == "unplug":
        return Change("unplug", args["device"])
    return Change("plug", args["device"])


def storm(
    rng: random.Random,
    *,
    start: float,
    changes: int,
    over: float,
    devices: Sequence[str],
    ops: Sequence[Op] = STORM_OPS_DEFAULT,
    max_vfs: int = 0,
    step: int = 0,
    shows: Callable[[str, Reason], bool] | None = None,
) -> list[Action]:
    """``changes`` random changes spread evenly over ``over`` seconds from ``start``.
    ``shows(device, reason)``: whether the device can show that fault; a drawn reason it
    cannot is aer-fatal instead (which every device shows), so the draws stay the same."""
    out = []
    for k in range(changes):
        op = rng.choice(ops)
        device = rng.choice(devices)
        if op == "health":
            h, r = rng.choice(STORM_HEALTH)
            if r is not None and shows is not None and not shows(device, r):
                r = Reason.AER_FATAL
            change = Change("health", device, health=h, reason=r)
        elif op == "set-vfs":
            change = Change("set-vfs", device, num_vfs=rng.randint(0, max_vfs))
        else:
            change = Change(op, device)
        out.append(Action(start + over * k / changes, step, change))
    return out


def expand(scenario: Scenario, devices: Sequence[str],
           shows: Callable[[str, Reason], bool] | None = None) -> list[Action]:
    """Every action of ``scenario`` in time order (stable for equal times). Pure.

    ``devices`` is the node's device list, used by storms without their own; ``shows``
    as for ``storm``."""
    actions: list[Action] = []
    for i, st in enumerate(scenario.steps):
        if st.do == "storm":
            rng = random.Random(int(st.args.get("seed", scenario.seed)) * 1_000_003 + i)
            for r in range(st.repeat):
                actions += storm(
                    rng,
                    start=st.at + r * st.every,
                    changes=st.args["changes"],
                    over=float(st.args.get("over", 0.0)),
                    devices=st.args.get("devices") or list(devices),
                    ops=st.args.get("ops") or STORM_OPS_DEFAULT,
                    max_vfs=st.args.get("max_vfs", 0),
                    step=i,
                    shows=shows,
                )
            if st.expect:
                end = st.at + (st.repeat - 1) * st.every + float(st.args.get("over", 0.0))
                actions.append(Action(end, i, None, st.expect))
            if st.pod_expect:
                end = st.at + (st.repeat - 1) * st.every + float(st.args.get("over", 0.0))
                actions.append(Action(end, i, None, None, st.pod_expect))
            continue
        for r in range(st.repeat):
            last = r == st.repeat - 1
            change = _change(st.do, st.args) if st.do else None
            actions.append(Action(st.at + r * st.every, i, change, st.expect if last else None,
                                  st.pod_expect if last else None))
    return sorted(actions, key=lambda a: a.at)


# -- running ------------------------------------------------------------------------------
def _request(change: Change) -> dict[str, Any]:
    fields: dict[str, Any] = {"device": change.device}
    if change.op == "health":
        assert change.health is not None
        fields["health"] = change.health.value
        if change.reason is not None:
            fields["reason"] = change.reason.value
    if change.op == "set-vfs":
        fields["num_vfs"] = change.num_vfs
        if change.port is not None:
            fields["port"] = change.port
    return fields


def apply_action(client: Client, change: Change) -> dict[str, Any]:
    """Send one change through the client (the same request the CLI would send)."""
    return client.request(change.op, **_request(change))


def run_scenario(
    scenario: Scenario,
    client: Client,
    *,
    speed: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_action: Callable[[Action, dict[str, Any]], None] | None = None,
    on_wait: Callable[[Action], None] | None = None,
    wait_slice: float = 1.0,
    pod_health: PodHealth | None = None,
) -> ScenarioResult:
    """Perform ``scenario`` through ``client`` in real time (``speed`` 2 = twice as fast).

    Stops with ScenarioError at the first change the server refuses. Expectations are
    recorded, not raised: check ``result.ok`` / ``result.failures``. ``on_action`` is
    called after each change; a wait for the next action is slept in slices of at most
    ``wait_slice`` seconds, with ``on_wait(next action)`` after each (progress output).
    ``pod_health`` answers the pod expectations; a scenario with some and no
    ``pod_health`` is refused before anything is sent."""
    if speed <= 0:
        raise ScenarioError([f"{scenario.source}: speed must be > 0"])
    if pod_health is None:
        pods = [f"{scenario.source}{':' + st.where if st.where else ''}: steps[{i}].expect: "
                f"{st.pod_expect} needs a Kubernetes API server (a sandbox of runtime native "
                "or kind)" for i, st in enumerate(scenario.steps) if st.pod_expect is not None]
        if pods:
            raise ScenarioError(pods)
    try:
        listed = client.devices()
    except ControlError as exc:
        raise ScenarioError([f"{scenario.source}: cannot list devices: {exc}"]) from exc
    shown = {d: fault_reasons(str(info.get("kind", "")), info.get("vendor"))
             for d, info in listed.items()}

    def shows(device: str, reason: Reason) -> bool:
        return reason.value in shown.get(device, (reason.value,))

    result = ScenarioResult()
    t0 = clock()
    for action in expand(scenario, sorted(listed), shows):
        delay = t0 + action.at / speed - clock()
        while delay > 0:
            if on_wait is None:
                sleep(delay)
                break
            sleep(min(delay, wait_slice) if wait_slice > 0 else delay)
            on_wait(action)
            delay = t0 + action.at / speed - clock()
        if action.change is not None:
            try:
                reply = apply_action(client, action.change)
            except ControlError as exc:
                where = scenario.steps[action.step].where
                source = f"{scenario.source}:{where}" if where else scenario.source
                raise ScenarioError(
                    [f"{source}: steps[{action.step}] at {action.at:g}s: {exc}"]
                ) from exc
            result.applied.append((action, reply))
            if on_action is not None:
                on_action(action, reply)
        if action.expect:
            now = client.devices()
            for dev, want in action.expect.items():
                got = now.get(dev)
                actual = got["state"] if got else None
                result.checks.append(Check(action.at, action.step, dev, want, actual))
        if action.pod_expect is not None and pod_health is not None:
            want_pod = action.pod_expect
            seen = pod_health(want_pod.namespace, want_pod.pod, want_pod.device,
                              want_pod.container)
            result.checks.append(PodCheck(action.at, action.step, want_pod, tuple(seen)))
    return result
