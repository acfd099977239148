"""A change to one device of a live node, and the device state it leads to.

``Change`` is what the control API's requests become (``control.protocol``) and what
fault scenarios produce (``control.scenario``); ``next_state`` is the one rule for the
state a device is in after one, which the live tree (``serve.live``) applies. Shared by
the server and its clients: nothing here serves or sends anything.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from sandbox.errors import ControlError
from sandbox.fakehw import mig as migrule
from sandbox.fakehw.tree import DeviceState, Health, MigGeometry, Reason

Op = Literal["health", "unplug", "plug", "set-vfs", "mig-mode", "gi-create", "gi-destroy",
             "ci-create", "ci-destroy", "mig-reset"]
OPS: tuple[Op, ...] = ("health", "unplug", "plug", "set-vfs", "mig-mode", "gi-create",
                       "gi-destroy", "ci-create", "ci-destroy", "mig-reset")
# what faults (the CLI, scenarios) do; the MIG ops are NVML's (sandbox.fakehw.mig)
FAULT_OPS: tuple[Op, ...] = ("health", "unplug", "plug", "set-vfs")


@dataclass(frozen=True)
class Change:
    """One requested change to one device (already validated by its producer)."""

    op: Op
    device: str
    health: Health | None = None
    reason: Reason | None = None
    num_vfs: int | None = None
    port: int | None = None  # set-vfs: one physical function (0-based) instead of all
    # MIG (sandbox.fakehw.mig): mig-mode's mode; a GPU or compute instance profile id,
    # a placement's start, a GPU / compute instance id
    enabled: bool | None = None
    profile: int | None = None
    start: int | None = None
    gi: int | None = None
    ci: int | None = None

    def __post_init__(self) -> None:
        if self.op == "health":
            if self.health is None:
                raise ControlError("health: a health value is required")
            if self.health is Health.HEALTHY and self.reason is not None:
                raise ControlError("health: a healthy device takes no reason")
            if self.health is Health.UNHEALTHY and self.reason is None:
                raise ControlError("health: an unhealthy device needs a reason")
        if self.op == "set-vfs" and (self.num_vfs is None or self.num_vfs < 0):
            raise ControlError("set-vfs: num_vfs must be a non-negative integer")
        if self.port is not None and (self.op != "set-vfs" or self.port < 0):
            raise ControlError("port: only set-vfs takes a port, a non-negative integer")
        needs = {"mig-mode": ("enabled",), "gi-create": ("profile",), "gi-destroy": ("gi",),
                 "ci-create": ("gi", "profile"), "ci-destroy": ("gi", "ci")}.get(self.op, ())
        for name in needs:
            if getattr(self, name) is None:
                raise ControlError(f"{self.op}: {name} is required")


def next_state(state: DeviceState, change: Change, mig: MigGeometry | None = None
               ) -> DeviceState:
    """The state a device is in after ``change``.

    ``health unhealthy removed`` also unplugs (the device fell off the bus); ``plug``
    of a device removed that way brings it back healthy. MIG changes follow
    ``sandbox.fakehw.mig`` on the GPU's geometry ``mig``.
    """
    if change.op in migrule.MIG_OPS:
        return migrule.next_state(mig, state, change)
    if change.op == "health":
        assert change.health is not None
        plugged = state.plugged and change.reason is not Reason.REMOVED
        return replace(state, health=change.health, reason=change.reason, plugged=plugged)
    if change.op == "unplug":
        return replace(state, plugged=False)
    if change.op == "plug":
        if state.reason is Reason.REMOVED:
            return replace(state, plugged=True, health=Health.HEALTHY, reason=None)
        return replace(state, plugged=True)
    if change.port is None:  # every physical function
        return replace(state, num_vfs=change.num_vfs, port_vfs=())
    assert change.num_vfs is not None
    ports = dict(state.port_vfs)
    ports[change.port] = change.num_vfs
    return replace(state, port_vfs=tuple(sorted(ports.items())))
