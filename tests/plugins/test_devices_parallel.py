"""``hwplugins.devices.Scanner`` reads a big node's PCI functions it never read with several
threads (``readers``); the records must be exactly those one reader gets, in the same
order, on a rendered node of 128 GPUs (benchmarks/_profiles.py's shape: 2 NUMA nodes, 2
host bridges), healthy and with faults and unplugged devices spread over it."""

from __future__ import annotations

import sys
from pathlib import Path

from hwplugins.devices import PARALLEL_FROM, Scanner

from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.fakehw.tree import DeviceState, Health, Reason
from sandbox.profile import load_profile
from tests.support.paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from _profiles import NODE, gpu_profile  # noqa: E402


def test_parallel_readers_scan_what_one_reader_scans(tmp_path: Path) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text(gpu_profile(128))
    node = load_profile(str(profile)).cluster.node(NODE)
    assert node is not None
    root = tmp_path / "root"
    sick = DeviceState(Health.UNHEALTHY, Reason.AER_FATAL)
    states = {d.id: sick if i % 3 else DeviceState(plugged=False)
              for i, d in enumerate(node.devices[::7])}  # fmt: skip
    for variant in ({}, states):
        render(build_tree(node, variant), root, force=True)
        one = Scanner(root, readers=1).scan()
        assert len(one) >= PARALLEL_FROM  # the parallel path is taken
        many = Scanner(root, readers=4)
        assert many.scan() == one
        assert many.scan() == one  # a rescan of what it read before: one reader again
        assert [d.address for d in one] == sorted(d.address for d in one)
