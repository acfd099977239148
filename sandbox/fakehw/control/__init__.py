"""Talking to a live node: the control API's client, its wire format and fault scenarios.

    client     ControlClient, the blocking client the CLI, runtimes and tests use
    protocol   the wire format: socket paths, request parsing, limits (docs/control-api.md)
    scenario/  fault scenarios: a timeline of control calls, loaded from YAML, run through
               a client

The server is ``sandbox.fakehw.serve.controlserver``; nothing here imports it (or trio).
"""

from sandbox.fakehw.control.client import ControlClient
from sandbox.fakehw.control.protocol import (
    MAX_LINE,
    PROTOCOL_VERSION,
    ControlPaths,
    control_paths,
    decode_request,
    parse_request,
)

__all__ = [
    "MAX_LINE", "PROTOCOL_VERSION", "ControlClient", "ControlPaths", "control_paths",
    "decode_request", "parse_request",
]
