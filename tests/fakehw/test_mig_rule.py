"""The MIG lifecycle rule (sandbox.fakehw.mig) on its own: what each change does to a
GPU's state, every refusal's code (the NVML return code our library maps it to), and the
saved-state form of the result."""

from __future__ import annotations

import pytest

from sandbox.errors import ControlError
from sandbox.fakehw import mig
from sandbox.fakehw.changes import Change, next_state
from sandbox.fakehw.states import state_from_json, state_to_json
from sandbox.fakehw.tree import DeviceState, GpuInstance, MigGeometry, MigProfile

A100 = MigGeometry(8, 7, (MigProfile(0, "1g.10gb", 1, 1), MigProfile(1, "2g.20gb", 2, 2),
                          MigProfile(2, "3g.40gb", 3, 4), MigProfile(4, "7g.80gb", 7, 8)),
                   True, (GpuInstance(1, 2, 0), GpuInstance(2, 1, 4), GpuInstance(3, 0, 6),
                          GpuInstance(4, 0, 7)))  # fmt: skip


def apply(state: DeviceState, op: str, **fields: object) -> DeviceState:
    return next_state(state, Change(op, "gpu0", **fields), A100)  # type: ignore[arg-type]


def refused(state: DeviceState, op: str, **fields: object) -> str | None:
    with pytest.raises(ControlError) as exc:
        apply(state, op, **fields)
    return exc.value.code


def empty() -> DeviceState:
    s = DeviceState()
    for g in A100.layout:
        s = apply(apply(s, "ci-destroy", gi=g.gi, ci=0), "gi-destroy", gi=g.gi)
    return s


def test_the_profile_layout_until_nvml_changes_it() -> None:
    assert mig.instances(A100, DeviceState()) == A100.layout
    assert mig.placements(A100, A100.profiles[2]) == [0, 4]
    assert mig.placements(A100, A100.profiles[1]) == [0, 2, 4]
    assert mig.placements(A100, A100.profiles[0]) == [0, 1, 2, 3, 4, 5, 6]  # 7 compute slices
    assert empty().mig == ()
    assert empty().mig_mode is True


def test_creates_take_the_lowest_free_id_and_the_first_placement_that_fits() -> None:
    s = apply(empty(), "gi-create", profile=1, start=2)
    s = apply(s, "gi-create", profile=0)
    assert s.mig == (GpuInstance(1, 1, 2, ci=False), GpuInstance(2, 0, 0, ci=False))
    assert mig.remaining(A100, s, A100.profiles[2]) == 1  # 3g.40gb: at 4 only
    s = apply(s, "ci-create", gi=2, profile=0)
    assert s.mig == (GpuInstance(1, 1, 2, ci=False), GpuInstance(2, 0, 0, ci=True))
    assert mig.created(A100, empty(), apply(empty(), "gi-create", profile=2)) == 1


@pytest.mark.parametrize(("op", "fields", "code"), [
    ("gi-create", {"profile": 2, "start": 0}, "insufficient-resources"),  # 3g@0 is taken
    ("gi-create", {"profile": 1, "start": 1}, "invalid-argument"),  # 2g starts at 0, 2, 4
    ("gi-create", {"profile": 3}, "not-supported"),  # 4g.40gb is not offered
    ("gi-create", {"profile": 0}, "insufficient-resources"),  # all 7 compute slices used
    ("gi-destroy", {"gi": 1}, "in-use"),  # its compute instance exists
    ("gi-destroy", {"gi": 9}, "not-found"),
    ("ci-create", {"gi": 1, "profile": 2}, "insufficient-resources"),  # it has one
    ("ci-create", {"gi": 1, "profile": 0}, "not-supported"),  # not the one spanning it
    ("ci-destroy", {"gi": 1, "ci": 1}, "not-found"),
    ("mig-mode", {"enabled": False}, "in-use"),  # instances exist
])
def test_refusals_carry_the_code_nvml_returns(op: str, fields: dict[str, object],
                                              code: str) -> None:  # fmt: skip
    assert refused(DeviceState(), op, **fields) == code


def test_reset_goes_back_to_the_profile() -> None:
    changed = apply(empty(), "mig-mode", enabled=False)
    assert apply(changed, "mig-reset") == DeviceState()
    assert mig.instances(A100, apply(changed, "mig-reset")) == A100.layout


def test_mig_mode_off_refuses_instances_and_on_starts_empty() -> None:
    off = apply(empty(), "mig-mode", enabled=False)
    assert mig.instances(A100, off) == ()
    assert refused(off, "gi-create", profile=0) == "not-supported"
    assert apply(off, "mig-mode", enabled=False) == off  # no change
    assert apply(off, "mig-mode", enabled=True).mig == ()
    with pytest.raises(ControlError) as exc:
        next_state(DeviceState(), Change("gi-create", "nic0", profile=0), None)
    assert exc.value.code == "not-supported"


def test_saved_states_keep_mig_and_refuse_bad_instances() -> None:
    s = apply(empty(), "gi-create", profile=2, start=4)
    assert state_from_json(state_to_json(s), "x") == s
    assert "mig" not in state_to_json(DeviceState())  # older readers see what they knew
    for bad in ([{"gi": 1, "profile": 0, "start": 0}],  # ci missing
                [{"gi": 1, "profile": 0, "start": 0, "ci": 1}],
                [{"gi": 1, "profile": 0, "start": 0, "ci": True}] * 2,
                {"gi": 1}):
        with pytest.raises(ControlError):
            state_from_json({"mig": bad}, "x")
