"""The schema documents the limits the resolver enforces, from the same constants."""

from __future__ import annotations

from sandbox.profile.resolve import limits
from sandbox.profile.schema import profile_schema


def test_schema_descriptions_state_the_resolver_limits() -> None:
    schema = profile_schema()
    defs = schema["$defs"]
    assert defs["Cpu"]["description"] == (
        f"sockets x coresPerSocket x threadsPerCore may be at most {limits.MAX_CPUS} "
        "logical CPUs.")
    assert defs["Node"]["properties"]["devices"]["description"] == (
        f"at most {limits.MAX_DEVICES} devices (the sum of counts) and "
        f"{limits.MAX_FUNCTIONS} PCI functions (every possible SR-IOV VF included) per node")
    assert schema["properties"]["nodes"]["description"] == (
        f"at most {limits.MAX_NODES} nodes, replicas (count) included")
    assert schema["properties"]["nodes"]["maxItems"] == limits.MAX_NODES
