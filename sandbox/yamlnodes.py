"""A YAML document's node tree (values with where they start), composed by libyaml.

Profiles and fault scenarios are read as node trees, not plain values, so that every
problem can name its line and column. PyYAML's pure-Python parser took two thirds of
loading a profile (4.1 ms of 8gpu-2numa.yaml's ~6 ms here); PyYAML's libyaml binding
builds the same nodes, with the same marks, in 0.23 ms. Its error messages are terser
than the pure-Python parser's ("did not find expected node content" where the other says
what it found instead), and it cannot take text that is not valid UTF-8 (lone
surrogates). So libyaml only answers when it parses the text without a complaint; for
anything else (including a PyYAML built without libyaml) the caller's pure-Python
loader parses the text again and its error is the one reported.
"""

from __future__ import annotations

from typing import Any

import yaml

_CLoader: Any = getattr(yaml, "CSafeLoader", None)


def compose_fast(text: str) -> tuple[Any, yaml.Node | None] | None:
    """``(loader, root)`` for the single document of ``text``: the root node (None for an
    empty stream) and a loader whose ``construct_object`` makes a node's value as
    ``yaml.SafeLoader`` would; None where libyaml is missing or has any problem with the
    text (then parse it with the pure-Python loader, whose messages are clearer)."""
    if _CLoader is None:
        return None
    try:
        loader = _CLoader(text)
    except Exception:  # noqa: BLE001 - whatever libyaml says, the slow path says better
        return None
    try:
        root = loader.get_single_node()
    except Exception:  # noqa: BLE001 - as above (surrogates, nesting past libyaml's 1,000)
        return None
    finally:
        loader.dispose()
    return loader, root
