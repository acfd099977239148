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
from sandbox.fakehw.scenario.parse import (
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
    Scenario,
    Step,
    count_changes,
    load_scenario,
    parse_scenario,
    parse_scenario_text,
)
from sandbox.fakehw.scenario.run import (
    STORM_HEALTH,
    STORM_OPS_DEFAULT,
    Action,
    Check,
    Client,
    ScenarioResult,
    apply_action,
    expand,
    run_scenario,
    storm,
)

__all__ = [
    "ACTIONS", "EXPECT_KEYS", "MAX_ACTIONS", "MAX_BYTES", "MAX_DEPTH", "MAX_PORT",
    "MAX_SECONDS", "MAX_SEED", "MAX_VALUES", "MAX_VFS", "STORM_HEALTH", "STORM_OPS_DEFAULT",
    "Action", "Check", "Client", "Scenario", "ScenarioError", "ScenarioResult", "Step",
    "apply_action", "count_changes", "expand", "load_scenario", "parse_scenario",
    "parse_scenario_text", "run_scenario", "storm",
]
