"""Fault scenarios: a timeline of control calls, loaded from YAML and run against a node.

    version: 1
    seed: 7                       # for storms; default 0
    steps:
      - {at: 0.5, do: health, device: gpu0, health: unhealthy, reason: aer-fatal}
      - {at: 1.0, do: unplug, device: nic0, repeat: 3, every: 2.0}
      - {at: 1.5, do: plug, device: nic0, repeat: 3, every: 2.0}
      - {at: 2.0, do: set-vfs, device: gpu1, num_vfs: 4}
      - {at: 3.0, do: storm, changes: 100, over: 5.0, devices: [gpu0, gpu1],
         ops: [health, unplug, plug]}
      - {at: 9.0, expect: {gpu0: {plugged: true}, gpu1: {num_vfs: 4}}}
      - {at: 12.0, expect: {pod: default/train, device: gpu0, health: Unhealthy}}

An ``expect`` is either the state of devices by id (as ``sandbox fault list`` shows it:
health, reason, plugged, num_vfs) or, when it has a ``pod`` key with a string value,
what a pod's status says of a device it holds (``pod``: NAMESPACE/NAME or NAME in the
namespace default; ``device``: the profile's id, or the kubelet's resource id itself;
``health``: Healthy, Unhealthy or Unknown, as a 1.37 kubelet writes
``allocatedResourcesStatus``; optional ``container``). The latter needs a Kubernetes API
server: ``run_scenario(..., pod_health=...)``. It holds when the pod's status has the
device and every entry of it has that health.

``load_scenario`` validates the whole file and reports every problem at once
(``ScenarioError``), each located like a profile problem: ``file:line:col: path: message``
(a document given as a Python object, ``parse_scenario(doc)``, has no lines to name).
``expand`` turns a scenario into a flat, time-sorted list of ``Action``s (pure: a storm
is drawn from ``random.Random`` seeded by the scenario seed and the step number, so the
same file always gives the same changes). ``run_scenario`` performs the actions through a
``ControlClient`` at their times and returns the ``expect`` checks for the caller to
assert on.

Modules: ``parse`` (reading and validating a file, with the bounds and the YAML-mark
locations; ``Step``, ``Scenario``), ``run`` (expansion, storms and the runner; ``Action``,
``Check``, ``ScenarioResult``). The names below are the public API of both.
"""

from __future__ import annotations

from sandbox.errors import ScenarioError
from sandbox.fakehw.control.scenario.parse import (
    ACTIONS,
    EXPECT_KEYS,
    MAX_ACTIONS,
    MAX_BYTES,
    MAX_DEPTH,
    MAX_PORT,
    MAX_SECONDS,
    MAX_SEED,
    MAX_VALUES,
    MAX_VFS,
    POD_EXPECT_KEYS,
    POD_HEALTH,
    PodExpect,
    Scenario,
    Step,
    count_changes,
    load_scenario,
    parse_scenario,
    parse_scenario_text,
)
from sandbox.fakehw.control.scenario.run import (
    STORM_HEALTH,
    STORM_OPS_DEFAULT,
    Action,
    Check,
    Client,
    PodCheck,
    PodHealth,
    ScenarioResult,
    apply_action,
    expand,
    run_scenario,
    storm,
)

__all__ = [
    "ACTIONS", "EXPECT_KEYS", "MAX_ACTIONS", "MAX_BYTES", "MAX_DEPTH", "MAX_PORT",
    "MAX_SECONDS", "MAX_SEED", "MAX_VALUES", "MAX_VFS", "POD_EXPECT_KEYS", "POD_HEALTH",
    "STORM_HEALTH", "STORM_OPS_DEFAULT", "Action", "Check", "Client", "PodCheck", "PodExpect",
    "PodHealth", "Scenario", "ScenarioError", "ScenarioResult", "Step",
    "apply_action", "count_changes", "expand", "load_scenario", "parse_scenario",
    "parse_scenario_text", "run_scenario", "storm",
]
