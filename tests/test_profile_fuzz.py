"""Property: whatever the document, the loader returns a profile or raises ProfileError."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox.errors import ProfileError
from sandbox.profile import load_profile_text

ROOT = Path(__file__).resolve().parent.parent
SEEDS = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "profiles").glob("*.yaml"))]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["0x10de", "80Gi", "-1", "gpu", "nic", "0-3,9", ""]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated_profiles(draw: st.DrawFn) -> str:
    doc = copy.deepcopy(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "delete", "add", "dup"]))
        if not path:
            doc = draw(values) if action == "replace" else doc
            continue
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        key = path[-1]
        if action == "replace":
            parent[key] = draw(values)
        elif action == "delete":
            del parent[key]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=10))] = draw(values)
        elif action == "dup" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
    return yaml.safe_dump(doc, sort_keys=False)


raw_text = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    st.sampled_from(["a: &x [*x]", "- - - - -", "? [a]\n: b", "!!python/object:os.system {}",
                     "a: !!binary AAAA", "{" * 80, "a: 1\n---\nb: 2"]),
)


def _problems(text: str) -> list[object]:
    """The problems the loader reports; any exception but ProfileError fails the test."""
    try:
        load_profile_text(text, "fuzz.yaml")
    except ProfileError as exc:
        problems: list[object] = list(exc.problems)
        if not problems:
            raise AssertionError("ProfileError without problems") from exc
        return problems
    return []


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_profiles())
def test_mutated_profiles_only_raise_profile_error(text: str) -> None:
    problems = _problems(text)
    assert all(str(p).startswith("fuzz.yaml:") for p in problems)


@settings(max_examples=500, deadline=None)
@given(raw_text)
def test_arbitrary_text_only_raises_profile_error(text: str) -> None:
    _problems(text)
