"""``rebuild`` callables over shipped profiles, for ``bench_fs.py --rebuild MODULE:FUNC``."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from pathlib import Path

from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.tree import DeviceState, Tree
from sandbox.profile import NodeSpec, load_profile

REPO = Path(__file__).resolve().parent.parent


@cache
def _node(profile: str, node: str) -> NodeSpec:
    spec = load_profile(REPO / "profiles" / profile).cluster.node(node)
    assert spec is not None
    return spec


def demo(states: Mapping[str, DeviceState]) -> Tree:
    """The README's demo node: profiles/8gpu-2numa.yaml, gpu-worker."""
    return build_tree(_node("8gpu-2numa.yaml", "gpu-worker"), states)
