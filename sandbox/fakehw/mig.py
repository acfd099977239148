"""MIG lifecycle on one GPU: the rule for its mode and GPU/compute instances.

NVML's lifecycle calls (``nvmlDeviceSetMigMode``, ``nvmlDeviceCreateGpuInstance[With
Placement]``, ``nvmlGpuInstanceDestroy``, ``nvmlGpuInstanceCreateComputeInstance``,
``nvmlComputeInstanceDestroy``) reach the node's control server as the ``mig-mode``,
``gi-create``, ``gi-destroy``, ``ci-create`` and ``ci-destroy`` changes (and ``sandbox
fault reset`` sends ``mig-reset``: back to the profile's); ``next_state`` is
the one rule for what they do, and refuses what the real driver refuses, with a ``code``
our NVML maps onto NVML's return codes (docs/nvml.md, "Dynamic MIG"). The resulting
``DeviceState.mig`` is what the tree builder lays out (NVML state file, capabilities,
``/dev/nvidia-caps``), so every reader of the node sees an instance at once, and it is
saved with the other states across a restart of the server.

Placements are in memory slices: a profile of ``m`` memory slices may start at multiples
of ``m`` while it fits and its compute slices stay inside the GPU's (the rule our NVML's
``nvmlDeviceGetGpuInstancePossiblePlacements`` reports). Two instances may not share a
memory slice, and their compute slices together may not exceed the GPU's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from sandbox.errors import ControlError
from sandbox.fakehw.tree import DeviceState, GpuInstance, MigGeometry, MigProfile

if TYPE_CHECKING:
    from sandbox.fakehw.changes import Change

MIG_OPS = ("mig-mode", "gi-create", "gi-destroy", "ci-create", "ci-destroy", "mig-reset")
MAX_GPU_INSTANCES = 14  # GPU instance ids 1..14, as the driver's nvidia-caps layout has room


def refuse(code: str, message: str) -> ControlError:
    return ControlError(message, code=code)


def mode_of(geo: MigGeometry, state: DeviceState) -> bool:
    return geo.mode if state.mig_mode is None else state.mig_mode


def instances(geo: MigGeometry, state: DeviceState) -> tuple[GpuInstance, ...]:
    """The GPU instances the GPU holds now (none with MIG mode off)."""
    if not mode_of(geo, state):
        return ()
    return geo.layout if state.mig is None else state.mig


def profile_by_id(geo: MigGeometry, pid: int) -> MigProfile | None:
    return next((p for p in geo.profiles if p.id == pid), None)


def placements(geo: MigGeometry, p: MigProfile) -> list[int]:
    """Where instances of ``p`` may start (memory slices)."""
    out, start = [], 0
    while start + p.memory_slices <= geo.memory_slices and \
            start + p.compute_slices <= geo.compute_slices:
        out.append(start)
        start += p.memory_slices
    return out


def _fits(geo: MigGeometry, have: tuple[GpuInstance, ...], p: MigProfile, start: int) -> bool:
    used: set[int] = set()
    compute = 0
    for g in have:
        q = profile_by_id(geo, g.profile)
        if q is None:
            continue
        used.update(range(g.start, g.start + q.memory_slices))
        compute += q.compute_slices
    return compute + p.compute_slices <= geo.compute_slices and \
        not used.intersection(range(start, start + p.memory_slices))


def remaining(geo: MigGeometry, state: DeviceState, p: MigProfile) -> int:
    """How many more instances of ``p`` could be created now, one after another."""
    have, n = instances(geo, state), 0
    while True:
        start = next((s for s in placements(geo, p) if _fits(geo, have, p, s)), None)
        if start is None or len(have) >= MAX_GPU_INSTANCES:
            return n
        have = (*have, GpuInstance(0, p.id, start))
        n += 1


def next_state(geo: MigGeometry | None, state: DeviceState, change: Change) -> DeviceState:
    """The state after one MIG change; ControlError (with ``code``) when refused."""
    where = f"{change.op} {change.device}"
    if geo is None:
        raise refuse("not-supported", f"{where}: not a MIG-capable GPU with partitions")
    if change.op == "mig-reset":  # `sandbox fault reset`: as the profile starts it
        return replace(state, mig_mode=None, mig=None)
    have = instances(geo, state)
    if change.op == "mig-mode":
        assert change.enabled is not None
        if change.enabled == mode_of(geo, state):
            return state
        if not change.enabled and have:
            raise refuse("in-use", f"{where}: {len(have)} GPU instance(s) exist; destroy them "
                                   "before turning MIG mode off")
        return replace(state, mig_mode=change.enabled, mig=())
    if not mode_of(geo, state):
        raise refuse("not-supported", f"{where}: MIG mode is off")
    if change.op == "gi-create":
        return _create_gi(geo, state, have, change, where)
    gi = next((g for g in have if g.gi == change.gi), None)
    if gi is None:
        raise refuse("not-found", f"{where}: no GPU instance {change.gi} (have "
                                  f"{', '.join(str(g.gi) for g in have) or 'none'})")
    others = tuple(g for g in have if g.gi != gi.gi)
    if change.op == "gi-destroy":
        if gi.ci:
            raise refuse("in-use", f"{where}: GPU instance {gi.gi} still holds compute "
                                   "instance 0; destroy it first")
        return replace(state, mig_mode=True, mig=others)
    if change.op == "ci-create":
        own = profile_by_id(geo, gi.profile)
        if own is None or change.profile != own.id:
            raise refuse("not-supported", f"{where}: GPU instance {gi.gi} takes only the "
                                          f"compute instance profile spanning it "
                                          f"({own.id if own else '?'})")
        if gi.ci:
            raise refuse("insufficient-resources", f"{where}: GPU instance {gi.gi} already "
                                                   "holds its compute instance")
        return replace(state, mig_mode=True,
                       mig=tuple(sorted((*others, replace(gi, ci=True)))))
    assert change.op == "ci-destroy"
    if change.ci != 0 or not gi.ci:
        raise refuse("not-found", f"{where}: GPU instance {gi.gi} has no compute instance "
                                  f"{change.ci}")
    return replace(state, mig_mode=True, mig=tuple(sorted((*others, replace(gi, ci=False)))))


def _create_gi(geo: MigGeometry, state: DeviceState, have: tuple[GpuInstance, ...],
               change: Change, where: str) -> DeviceState:
    assert change.profile is not None
    p = profile_by_id(geo, change.profile)
    if p is None:
        offered = ", ".join(f"{q.id} ({q.name})" for q in geo.profiles)
        raise refuse("not-supported", f"{where}: no GPU instance profile {change.profile} "
                                      f"(offered: {offered})")
    starts = placements(geo, p)
    if change.start is not None:
        if change.start not in starts:
            raise refuse("invalid-argument", f"{where}: {p.name} cannot start at memory slice "
                                             f"{change.start} (possible: "
                                             f"{', '.join(map(str, starts))})")
        if not _fits(geo, have, p, change.start):
            raise refuse("insufficient-resources", f"{where}: {p.name} at memory slice "
                                                   f"{change.start} overlaps an instance or "
                                                   "exceeds the compute slices left")
        start = change.start
    else:
        found = next((s for s in starts if _fits(geo, have, p, s)), None)
        if found is None:
            raise refuse("insufficient-resources", f"{where}: no room left for {p.name}")
        start = found
    used = {g.gi for g in have}
    gid = next((i for i in range(1, MAX_GPU_INSTANCES + 1) if i not in used), None)
    if gid is None:
        raise refuse("insufficient-resources", f"{where}: {MAX_GPU_INSTANCES} GPU instances "
                                               "exist already")
    made = GpuInstance(gid, p.id, start, ci=False)
    return replace(state, mig_mode=True, mig=tuple(sorted((*have, made))))


def created(geo: MigGeometry | None, before: DeviceState, after: DeviceState) -> int | None:
    """The id of the GPU instance a ``gi-create`` made (for its reply), else None."""
    if geo is None:
        return None
    old = {g.gi for g in instances(geo, before)}
    new = [g.gi for g in instances(geo, after) if g.gi not in old]
    return new[0] if len(new) == 1 else None
