"""The control API (real server over a real unix socket, on a real mount) and scenarios."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.errors import ControlError, SandboxError
from sandbox.fakehw.control import MAX_LINE, ControlClient, control_paths, parse_request
from sandbox.fakehw.control.scenario import (
    ScenarioError,
    expand,
    load_scenario,
    parse_scenario,
    run_scenario,
)
from tests.support.fakehw_toy import Server

pytestmark = [pytest.mark.root, pytest.mark.fuse]

GPU0 = "sys/devices/pci0000:00/0000:10:00.0"


@pytest.fixture
def client(shared_toy_server: Server) -> Iterator[ControlClient]:
    with ControlClient(shared_toy_server.socket) as c:
        yield c
        # leave the node as the next test expects it
        for dev in ("gpu0", "gpu1", "gpu2", "nic0"):
            c.plug(dev)
            c.health(dev, "healthy")
            c.set_vfs(dev, 0) if dev != "nic0" else None


def test_socket_is_root_only_next_to_the_mount(shared_toy_server: Server) -> None:
    st = os.stat(shared_toy_server.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == 0
    assert shared_toy_server.socket == control_paths(shared_toy_server.root).socket
    assert shared_toy_server.socket == shared_toy_server.root.parent / "root.sock"
    assert control_paths("/x/node", "/run/s").socket == Path("/run/s/control.sock")


def test_get_lists_every_device_with_state(
    client: ControlClient, shared_toy_server: Server
) -> None:
    reply = client.get()
    assert reply["ok"] is True
    assert reply["v"] == 1
    assert reply["mount"] == str(shared_toy_server.root)
    devs = {d["id"]: d for d in reply["devices"]}
    assert sorted(devs) == ["gpu0", "gpu1", "gpu2", "nic0"]
    assert devs["gpu0"]["pci_address"] == "0000:10:00.0"
    assert devs["gpu0"]["state"] == {
        "health": "healthy",
        "reason": None,
        "plugged": True,
        "num_vfs": None,
    }


BAD_REQUESTS: list[tuple[bytes, str]] = [
    (b"not json", "not a JSON line"),
    (b"[1, 2]", "a request must be a JSON object"),
    (b'{"op": "get"}', "v: missing protocol version"),
    (b'{"v": 2, "op": "get"}', "v: unsupported protocol version 2 (have 1)"),
    (b'{"v": 1}', "op: expected one of get, watch, health, unplug, plug, set-vfs, mig-mode, "
                  "gi-create, gi-destroy, ci-create, ci-destroy, mig-reset, got None"),
    (b'{"v": 1, "op": "explode"}', "op: expected one of"),
    (b'{"v": 1, "op": "get", "device": "gpu0"}', "get: unexpected field(s) device"),
    (b'{"v": 1, "op": "unplug"}', "unplug: device: expected a device id"),
    (b'{"v": 1, "op": "unplug", "device": 3}', "unplug: device: expected a device id"),
    (b'{"v": 1, "op": "unplug", "device": "gpu9"}', "unknown device 'gpu9' (have gpu0, gpu1"),
    (b'{"v": 1, "op": "health", "device": "gpu0"}', "health: health: expected one of healthy"),
    (
        b'{"v": 1, "op": "health", "device": "gpu0", "health": "unhealthy"}',
        "health: reason: expected one of aer-fatal, link-down, port-down, removed",
    ),
    (
        b'{"v": 1, "op": "health", "device": "gpu0", "health": "healthy", "reason": "x"}',
        "health: reason: a healthy device takes no reason",
    ),
    (b'{"v": 1, "op": "set-vfs", "device": "gpu0"}', "set-vfs: num_vfs: expected an integer"),
    (b'{"v": 1, "op": "set-vfs", "device": "gpu0", "num_vfs": -1}', "num_vfs: expected"),
    (b'{"v": 1, "op": "set-vfs", "device": "gpu0", "num_vfs": true}', "num_vfs: expected"),
    (
        b'{"v": 1, "op": "set-vfs", "device": "gpu0", "num_vfs": 9}',
        "set-vfs gpu0: num_vfs 9 exceeds sriov_totalvfs 4",
    ),
    (b'{"v": 1, "op": "get", "id": [1]}', "id: expected a string or an integer"),
    (b'{"v": 1, "op": "get", "node": 3}', "get: node: expected a node name"),
    (b'{"v": 1, "op": "unplug", "device": "gpu0", "node": ""}', "unplug: node: expected"),
    # Hostile: each of these used to stop the server, or was accepted.
    (b'{"v":1,"op":"get","id":' + b"9" * 5000 + b"}", "integer with more than 20 digits"),
    (b"[" * 3000 + b"]" * 3000, "nested deeper than 8 levels"),
    (b'{"a":' * 3000 + b"1" + b"}" * 3000, "nested deeper than 8 levels"),
    (b'{"v": true, "op": "get"}', "v: unsupported protocol version True"),
    (b'{"v": 1.0, "op": "get"}', "v: unsupported protocol version 1.0"),
    (b'{"v": 1, "op": "get", "op": "watch"}', "duplicate key 'op'"),
    (b'{"v": 1, "op": "set-vfs", "device": "gpu0", "num_vfs": NaN}', "NaN is not a JSON number"),
    (b'{"v": 1, "op": "get", "id": "\xff"}', "not a JSON line"),
]


@pytest.mark.parametrize(("line", "message"), BAD_REQUESTS)
def test_bad_request_gets_error_and_server_keeps_serving(
    client: ControlClient, shared_toy_server: Server, line: bytes, message: str
) -> None:
    reply = client.send_line(line)
    assert reply["ok"] is False
    assert reply["v"] == 1
    assert message in reply["error"]
    # same connection still works, and so does the mount
    assert client.get()["ok"] is True
    assert (shared_toy_server.root / GPU0 / "vendor").read_text() == "0x8086\n"


def test_id_is_echoed(client: ControlClient) -> None:
    assert client.call({"v": 1, "op": "get", "id": "abc"})["id"] == "abc"
    assert client.call({"v": 1, "op": "nope", "id": 7})["id"] == 7


@pytest.mark.parametrize("extra", [10, 300_000])
def test_oversized_line_is_refused_and_connection_closed(shared_toy_server: Server,
                                                         extra: int) -> None:
    # 300 KB past the limit: the server has read only part of it when it refuses the line;
    # it shuts its side and drops the rest, so the client gets the reply and then end of
    # file, never a reset (closing with unread bytes resets a unix socket's peer)
    with ControlClient(shared_toy_server.socket) as c:
        reply = c.send_line(b"x" * (MAX_LINE + extra))
        assert reply["ok"] is False
        assert "longer than" in reply["error"]
        with pytest.raises(ControlError, match="closed the connection"):
            c.get()
    with ControlClient(shared_toy_server.socket) as c:
        assert c.get()["ok"]


def test_client_errors_are_control_errors(tmp_path: Path, client: ControlClient) -> None:
    with pytest.raises(ControlError, match="cannot connect"):
        ControlClient(tmp_path / "nothing.sock")
    with pytest.raises(ControlError, match="unknown device"):
        client.unplug("gpu7")
    assert issubclass(ControlError, SandboxError)


def test_change_reply_and_noop(client: ControlClient) -> None:
    r = client.unplug("gpu2")
    assert r["changed"] is True
    assert r["state"]["plugged"] is False
    assert client.unplug("gpu2")["changed"] is False
    r = client.health("gpu2", "unhealthy", "removed")
    assert (r["state"]["health"], r["state"]["reason"]) == ("unhealthy", "removed")
    assert r["state"]["plugged"] is False
    r = client.plug("gpu2")  # back from "removed": healthy again
    assert (r["state"]["health"], r["state"]["reason"], r["state"]["plugged"]) == (
        "healthy",
        None,
        True,
    )


def test_watch_streams_events_until_client_closes(
    shared_toy_server: Server, client: ControlClient
) -> None:
    watcher = ControlClient(shared_toy_server.socket, timeout=10)
    events = watcher.watch()
    client.health("gpu1", "unhealthy", "aer-fatal")
    client.unplug("gpu1")
    client.get()  # not an event
    client.plug("gpu1")
    got = [next(events) for _ in range(3)]
    assert [(e["event"], e["op"], e["device"]) for e in got] == [
        ("change", "health", "gpu1"),
        ("change", "unplug", "gpu1"),
        ("change", "plug", "gpu1"),
    ]
    assert got[1]["state"]["plugged"] is False
    assert [e["seq"] for e in got] == [got[0]["seq"], got[0]["seq"] + 1, got[0]["seq"] + 2]
    watcher.close()
    # the server notices the closed watcher and keeps serving
    client.health("gpu1", "healthy")
    assert client.get()["ok"]


def test_parse_request_accepts_good_requests() -> None:
    r = parse_request(
        {"v": 1, "op": "health", "device": "n", "health": "unhealthy", "reason": "port-down"}
    )
    assert r.change is not None
    assert r.change.reason is not None
    assert r.change.reason.value == "port-down"
    assert parse_request({"v": 1, "op": "watch", "id": 3}).id == 3


# -- scenarios --------------------------------------------------------------------------
SCENARIO = """
version: 1
seed: 5
steps:
  - {at: 0.0, do: health, device: gpu0, health: unhealthy, reason: aer-fatal}
  - {at: 0.05, do: unplug, device: nic0, repeat: 2, every: 0.1}
  - {at: 0.1, do: plug, device: nic0, repeat: 2, every: 0.1}
  - {at: 0.2, do: set-vfs, device: gpu1, num_vfs: 3,
     expect: {gpu1: {num_vfs: 3, plugged: true}}}
  - {at: 0.3, do: storm, changes: 20, over: 0.2, devices: [gpu2], ops: [unplug, plug]}
  - {at: 0.6, do: plug, device: gpu2}
  - at: 0.7
    expect:
      gpu0: {health: unhealthy, reason: aer-fatal}
      nic0: {plugged: true}
      gpu2: {plugged: true}
"""


def test_scenario_runs_and_expectations_hold(
    tmp_path: Path, shared_toy_server: Server, client: ControlClient
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO)
    sc = load_scenario(path)
    result = run_scenario(sc, client, speed=2.0)
    assert result.ok, [str(c) for c in result.failures]
    assert len(result.checks) == 4
    assert len(result.applied) == 1 + 2 + 2 + 1 + 20 + 1
    aer = (shared_toy_server.root / GPU0 / "aer_dev_fatal").read_text()
    assert aer.endswith("TOTAL_ERR_FATAL 1\n")
    # a failing expectation is reported, not raised
    bad = parse_scenario({"steps": [{"at": 0, "expect": {"gpu0": {"plugged": False}}}]})
    failed = run_scenario(bad, client)
    assert not failed.ok
    assert "FAILED" in str(failed.failures[0])


def test_storm_is_deterministic_per_seed() -> None:
    sc = parse_scenario({"seed": 1, "steps": [{"at": 1, "do": "storm", "changes": 50, "over": 5}]})
    a = expand(sc, ["gpu0", "gpu1"])
    assert a == expand(sc, ["gpu0", "gpu1"])
    assert len(a) == 50
    assert a[0].at == 1
    assert a[-1].at < 6
    other = parse_scenario(
        {"seed": 2, "steps": [{"at": 1, "do": "storm", "changes": 50, "over": 5}]}
    )
    assert expand(other, ["gpu0", "gpu1"]) != a


def test_scenario_refused_change_raises(client: ControlClient) -> None:
    sc = parse_scenario({"steps": [{"at": 0, "do": "unplug", "device": "gpu42"}]}, source="x.yaml")
    with pytest.raises(ScenarioError, match=r"x.yaml: steps\[0\] at 0s: unplug: unknown device"):
        run_scenario(sc, client)


def test_scenario_validation_reports_every_problem(tmp_path: Path) -> None:
    doc = {
        "version": 2,
        "bogus": 1,
        "steps": [
            {"at": -1, "do": "unplug", "device": "gpu0"},
            {"at": 1, "do": "explode"},
            {"at": 1, "do": "health", "device": "gpu0", "health": "unhealthy"},
            {"at": 1, "do": "unplug", "device": "gpu0", "repeat": 3},
            {"at": 1, "do": "storm", "changes": 0, "ops": ["dance"]},
            {"at": 1, "expect": {"gpu0": {"color": "red", "plugged": "yes"}}},
            {"at": 1},
            {"at": 1, "do": "set-vfs", "device": "gpu0", "num_vfs": 2, "extra": 1},
        ],
    }
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(doc, source="s.yaml")
    assert exc.value.problems == [
        "s.yaml: bogus: unknown field",
        "s.yaml: version: unsupported version 2 (have 1)",
        "s.yaml: steps[0].at: expected a number of seconds, 0 to 604800",
        "s.yaml: steps[1].do: unknown action 'explode' "
        "(expected health, unplug, plug, set-vfs, storm)",
        "s.yaml: steps[2].reason: expected one of aer-fatal, link-down, port-down, removed, "
        "row-remap-pending, row-remap-failure, ecc-contained, ecc-uncontained",
        "s.yaml: steps[3].every: required (> 0) when repeat > 1",
        "s.yaml: steps[4].changes: expected an integer 1..100000",
        "s.yaml: steps[4].ops: expected a non-empty list of health, unplug, plug, set-vfs",
        "s.yaml: steps[5].expect.gpu0.color: unknown field "
        "(expected health, reason, plugged, num_vfs)",
        "s.yaml: steps[5].expect.gpu0.plugged: expected true or false",
        "s.yaml: steps[6]: needs `do` or `expect`",
        "s.yaml: steps[7].extra: unknown field for set-vfs",
    ]
    (tmp_path / "bad.yaml").write_text("steps: [")
    with pytest.raises(ScenarioError, match="bad.yaml:1:9: not YAML"):
        load_scenario(tmp_path / "bad.yaml")
    with pytest.raises(ScenarioError, match="missing.yaml:1:1: cannot read"):
        load_scenario(tmp_path / "missing.yaml")


LOCATED = """\
version: 2
bogus: 1
steps:
  - {at: -1, do: unplug, device: gpu0}
  - {at: 1, do: explode}
  - at: 1
    do: storm
    changes: 0
    ops: [dance]
  - {at: 1, expect: {gpu0: {color: red, plugged: "yes"}}}
  - {at: 1, do: unplug, device: gpu0, device: gpu1}
  - {at: 1, <<: {do: plug}}
"""


def test_scenario_problems_in_a_file_carry_line_and_column(
    tmp_path: Path, client: ControlClient
) -> None:
    """As profile problems do: ``file:line:col: path: message``, the column of the value
    (of the key, for an unknown or duplicate field)."""
    path = tmp_path / "s.yaml"
    path.write_text(LOCATED)
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    assert exc.value.problems == [
        f"{path}:11:39: steps[4].device: duplicate key",
        f"{path}:12:13: steps[5]: merge keys (<<) are not supported",
    ]
    path.write_text(LOCATED.rsplit("  - {at: 1, do: unplug", 1)[0])
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    assert exc.value.problems == [
        f"{path}:2:1: bogus: unknown field",
        f"{path}:1:10: version: unsupported version 2 (have 1)",
        f"{path}:4:10: steps[0].at: expected a number of seconds, 0 to 604800",
        f"{path}:5:17: steps[1].do: unknown action 'explode' "
        "(expected health, unplug, plug, set-vfs, storm)",
        f"{path}:8:14: steps[2].changes: expected an integer 1..100000",
        f"{path}:9:10: steps[2].ops: expected a non-empty list of health, unplug, plug, set-vfs",
        f"{path}:10:29: steps[3].expect.gpu0.color: unknown field "
        "(expected health, reason, plugged, num_vfs)",
        f"{path}:10:50: steps[3].expect.gpu0.plugged: expected true or false",
    ]
    for text, message in [
        ("steps: [{at: 1, do: unplug}", "1:28: not YAML: expected ',' or ']'"),
        ("steps: " + "[" * 70 + "]" * 70, "1:72: not YAML: nested deeper than 64 levels"),
        ("steps:\n  - {at: 1, do: \x07}", "2:17: not YAML: special characters"),
        ("- 1", "1:1: expected a mapping with `steps`"),
        ("# nothing", "1:1: empty file"),
    ]:
        path.write_text(text)
        with pytest.raises(ScenarioError, match=re.escape(f"{path}:{message}")):
            load_scenario(path)
    path.write_bytes(b"steps:\n  - {at: 1, do: \xff}")
    with pytest.raises(ScenarioError, match=re.escape(f"{path}:2:17: not UTF-8")):
        load_scenario(path)
    # a change the server refuses names the step's place too
    path.write_text("steps:\n  - {at: 0, do: plug, device: gpu0}\n"
                    "  - {at: 0, do: unplug, device: gpu42}\n")
    with pytest.raises(ScenarioError,
                       match=re.escape(f"{path}:3:5: steps[1] at 0s: unplug: unknown device")):
        run_scenario(load_scenario(path), client)


@pytest.mark.parametrize(("text", "message"), [
    ("steps: [{at: .inf, do: unplug, device: gpu0}]", "steps[0].at: expected a number"),
    ("steps: [{at: .nan, do: unplug, device: gpu0}]", "steps[0].at: expected a number"),
    ("steps: [{at: 1e300, do: unplug, device: gpu0}]", "steps[0].at: expected a number"),
    ("seed: " + "7" * 5000 + "\nsteps: [{at: 1, do: unplug, device: gpu0}]", "not YAML"),
    ("seed: " + "7" * 40 + "\nsteps: [{at: 1, do: unplug, device: gpu0}]",
     "seed: expected an integer"),
    ("steps: " + "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("steps: [{at: 1, do: storm, changes: 5, ops: [[unplug]]}]", "steps[0].ops: expected"),
    ("steps: [{at: 1, do: storm, changes: 1000000000}]", "steps[0].changes: expected"),
    ("steps: [{at: 1, do: unplug, device: gpu0, repeat: 1000000000, every: 1}]",
     "steps[0].repeat: expected"),
    ("steps: [{at: 1, do: storm, changes: 60000}, {at: 2, do: storm, changes: 60000}]",
     "steps: 120000 changes in all"),
    ("{1: 2, a: 3, steps: [{at: 1, expect: {gpu0: {plugged: true}}}]}", "1: unknown field"),
])
def test_hostile_scenarios_are_scenario_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError, match=re.escape(message)):
        load_scenario(path)


def test_a_scenario_that_is_not_utf8_is_a_scenario_error(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_bytes(b"steps: [{at: 1, do: unplug, device: \xff\xfe}]")
    with pytest.raises(ScenarioError, match="not UTF-8"):
        load_scenario(tmp_path / "s.yaml")


def test_raw_socket_protocol(shared_toy_server: Server) -> None:
    """The wire format without our client: newline-delimited JSON, replies in order."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)  # a missing reply fails the test instead of hanging it
        s.connect(str(shared_toy_server.socket))
        s.sendall(b'{"v":1,"op":"get","id":1}\n\n{"v":1,"op":"get","id":2}\n')
        f = s.makefile("rb")
        replies = [json.loads(f.readline()) for _ in range(3)]
        f.close()
    assert [r["id"] for r in replies] == [1, None, 2]
    assert replies[1]["ok"] is False  # the blank line: an error reply, in its turn


def test_per_port_vf_counts_survive_the_state_file() -> None:
    from sandbox.fakehw.changes import Change, next_state
    from sandbox.fakehw.states import state_from_json, state_to_json
    from sandbox.fakehw.tree import DeviceState

    s = next_state(DeviceState(), Change("set-vfs", "nic0", num_vfs=2))
    s = next_state(s, Change("set-vfs", "nic0", num_vfs=5, port=1))
    assert (s.vfs_of(0), s.vfs_of(1)) == (2, 5)
    assert state_from_json(json.loads(json.dumps(state_to_json(s))), "nic0") == s
    assert "port_vfs" not in state_to_json(DeviceState())  # unchanged for older readers
    s = next_state(s, Change("set-vfs", "nic0", num_vfs=0))  # no port: every function
    assert (s.vfs_of(0), s.vfs_of(1), s.port_vfs) == (0, 0, ())
    with pytest.raises(ControlError, match="port_vfs"):
        state_from_json({"port_vfs": {"x": 1}}, "nic0")
    with pytest.raises(ControlError, match=r"set-vfs: port: expected an integer 0\.\.255"):
        parse_request({"v": 1, "op": "set-vfs", "device": "nic0", "num_vfs": 1, "port": 300})
