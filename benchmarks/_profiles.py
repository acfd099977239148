"""Generated hardware profiles for the benchmarks: one node of N H100s.

``gpu_profile(gpus)`` is the node bench_scale and bench_up serve (2 NUMA nodes, one PCI
host bridge per 128 GPUs, at least 2); bench_plugin_idle asks for 4 NUMA nodes and 8
bridges. GPUs are spread evenly over the NUMA nodes (the first ones get the remainder);
host bridges alternate over them. The node is always named ``NODE``.
"""

from __future__ import annotations

NODE = "big"


def gpu_profile(gpus: int, *, numa: int = 2, bridges: int | None = None,
                cores_per_socket: int = 16, memory: str = "1Ti",
                name: str | None = None) -> str:  # fmt: skip
    """A profile (YAML text) of one node with ``gpus`` H100 SXM5 GPUs."""
    if bridges is None:
        bridges = max(2, -(-gpus // 128))
    lines = [
        "apiVersion: hwsandbox.dev/v1alpha1",
        "kind: HardwareProfile",
        f"metadata: {{name: {name or f'scale-{gpus}'}}}",
        "nodes:",
        f"  - name: {NODE}",
        f"    cpu: {{sockets: 2, coresPerSocket: {cores_per_socket}, threadsPerCore: 2}}",
        f"    memory: {memory}",
        "    numa:",
        f"      nodes: [{', '.join(f'{{id: {n}}}' for n in range(numa))}]",
        "    pci:",
        "      hostBridges:",
        *(f"        - {{domain: {d}, bus: 0, numaNode: {d % numa}}}" for d in range(bridges)),
        "    devices:",
    ]
    for node in range(numa):
        count = gpus // numa + (1 if node < gpus % numa else 0)
        if count:
            lines.append("      - {type: gpu, vendor: nvidia, model: h100-sxm5-80gb, "
                         f"count: {count}, numaNode: {node}}}")  # fmt: skip
    return "\n".join(lines) + "\n"
