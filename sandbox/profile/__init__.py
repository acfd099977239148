"""Hardware profiles: the YAML format, its validation and its fully defaulted form.

    load_profile(path) -> LoadedProfile(path, profile, cluster, text)

``path`` may also be ``-`` (standard input) or a bundled profile's name (``bundled``).

``profile`` is the document as written (``model``); ``cluster`` is every node replica
with every default filled in (computed by ``resolve``, typed by ``spec``), which the tree
builder consumes. ``spec.dump``/``spec.load`` write a resolved node or cluster as JSON
and read it back (docs/spec-format.md); ``defaults.defaulted_profile`` writes a profile
back as a profile with every default stated (``sandbox show -o yaml``).
"""

from typing import TYPE_CHECKING

from sandbox import lazy

if TYPE_CHECKING:
    from sandbox.profile.bundled import PROFILE_HELP
    from sandbox.profile.document import STDIN_NAME, format_loc
    from sandbox.profile.loader import LoadedProfile, load_profile, load_profile_text
    from sandbox.profile.model import API_VERSION, KIND, Profile
    from sandbox.profile.spec import Cluster, DeviceSpec, NodeSpec
else:
    __getattr__ = lazy.exports(__name__, {
        "bundled": ["PROFILE_HELP"],
        "document": ["STDIN_NAME", "format_loc"],
        "loader": ["LoadedProfile", "load_profile", "load_profile_text"],
        "model": ["API_VERSION", "KIND", "Profile"],
        "spec": ["Cluster", "DeviceSpec", "NodeSpec"],
    })

__all__ = [
    "API_VERSION",
    "KIND",
    "PROFILE_HELP",
    "STDIN_NAME",
    "Cluster",
    "DeviceSpec",
    "LoadedProfile",
    "NodeSpec",
    "Profile",
    "format_loc",
    "load_profile",
    "load_profile_text",
]
