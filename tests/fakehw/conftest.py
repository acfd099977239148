"""Shared by the reader tests of this directory: a profile node rendered once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.profile import load_profile
from sandbox.profile.spec import NodeSpec

_roots: dict[tuple[Path, str], tuple[NodeSpec, Path]] = {}


@pytest.fixture
def rendered(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
             ) -> tuple[NodeSpec, Path]:
    """(node, its rendered root) for ``request.param`` = (profile path, node name), made
    on first use and kept for the session (parametrize with ``indirect=True``)."""
    path, name = request.param
    key = (path, name)
    if key not in _roots:
        node = load_profile(path).cluster.node(name)
        assert node is not None
        root = tmp_path_factory.mktemp(f"{path.stem}-{name}")
        render(build_tree(node), root, force=True)
        _roots[key] = (node, root)
    return _roots[key]
