"""Profiles and scenarios are composed by libyaml (``sandbox.yamlnodes``) where PyYAML has
it: the same node tree and marks as PyYAML's own parser, and that parser's clearer
messages for anything libyaml complains about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sandbox.errors import ProfileError, ScenarioError
from sandbox.fakehw.control.scenario import parse_scenario_text
from sandbox.profile import load_profile_text
from sandbox.yamlnodes import compose_fast
from tests.support.paths import REPO


def _tree(node: Any) -> Any:
    """A node as plain data: kind, tag, value and both marks, recursively."""
    marks = (node.start_mark.line, node.start_mark.column, node.end_mark.line,
             node.end_mark.column)
    if isinstance(node, yaml.MappingNode):
        return ("map", node.tag, marks, [(_tree(k), _tree(v)) for k, v in node.value])
    if isinstance(node, yaml.SequenceNode):
        return ("seq", node.tag, marks, [_tree(item) for item in node.value])
    return ("scalar", node.tag, marks, node.value, node.style or None)  # libyaml: "" if plain


def test_pyyaml_here_has_libyaml() -> None:
    """The fast path is what runs (the wheels on PyPI carry libyaml)."""
    assert yaml.__with_libyaml__, "PyYAML without libyaml: pip install --force-reinstall pyyaml"


@pytest.mark.parametrize("path", sorted((REPO / "profiles").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_profile_composes_as_pyyaml_composes_it(path: Path) -> None:
    text = path.read_text()
    fast = compose_fast(text)
    assert fast is not None
    assert _tree(fast[1]) == _tree(yaml.compose(text, Loader=yaml.SafeLoader))


def test_a_complaint_is_pyyamls_message_at_its_place() -> None:
    """A truncated flow sequence: libyaml would say "did not find expected node content"
    at the line after; PyYAML names what it found, where it found it."""
    text = "apiVersion: hwsandbox.dev/v1alpha1\nnodes: [1,"
    assert compose_fast(text) is None
    with pytest.raises(ProfileError) as caught:
        load_profile_text(text, "cut.yaml")
    assert str(caught.value) == ("cut.yaml:2:11: invalid YAML: expected the node content, "
                                 "but found '<stream end>'")
    with pytest.raises(ScenarioError) as scenario:
        parse_scenario_text("steps: [1,", source="cut.yaml")
    assert [str(p) for p in scenario.value.problems] == [
        "cut.yaml:1:11: not YAML: expected the node content, but found '<stream end>'"]


def test_text_libyaml_cannot_take_is_reported_by_pyyaml() -> None:
    """A lone surrogate (not UTF-8) and nesting past libyaml's 1,000 levels."""
    assert compose_fast("a: \udcff\n") is None
    with pytest.raises(ProfileError, match=r"^s.yaml:1:1: invalid YAML: special characters"):
        load_profile_text("a: \udcff\n", "s.yaml")
    deep = "nodes: " + "[" * 2000 + "]" * 2000
    assert compose_fast(deep) is None
    with pytest.raises(ProfileError, match="nested too deeply"):
        load_profile_text(deep, "deep.yaml")


def test_a_tab_inside_a_plain_scalar_is_text_as_yaml_says() -> None:
    """YAML allows tabs inside plain scalars; PyYAML's own scanner refuses them, libyaml
    reads them: such a key is now an unknown field, located, not invalid YAML."""
    text = (REPO / "profiles" / "8gpu-2numa.yaml").read_text().replace(
        "metadata:", "meta\tdata:", 1)
    with pytest.raises(ProfileError) as caught:
        load_profile_text(text, "tab.yaml")
    shown = str(caught.value)
    assert "invalid YAML" not in shown
    assert "tab.yaml:10:1: meta\tdata: unknown field 'meta\\tdata' (did you mean 'metadata'?)" \
        in shown.splitlines(), shown
