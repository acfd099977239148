"""The package list in pyproject.toml covers every Python package in the tree."""

from __future__ import annotations

import tomllib

from tests.support.paths import REPO as ROOT


def test_every_package_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in ROOT.glob("sandbox/**/__init__.py")}
    found |= {".".join(p.parent.relative_to(ROOT / "plugins").parts)
              for p in (ROOT / "plugins").glob("hwplugins/**/__init__.py")}
    assert found <= listed, f"add to pyproject.toml [tool.setuptools] packages: {found - listed}"
    for package, directory in config["package-dir"].items():
        assert (ROOT / directory).is_dir(), package
