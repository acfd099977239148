#!/usr/bin/env python3
"""What one API read costs a fresh CLI process: ``sandbox.kubeapi`` (plain JSON) against
the official client's typed ``CoreV1Api`` (the baseline, what the runtimes used before),
both listing the nodes of a real kube-apiserver (etcd and kube-apiserver from
scripts/build-k8s, started here, root). Each round runs both, alternating, each in a new
Python process; CPU is the process's user + system time.

    python3 benchmarks/bench_kubeapi.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.plugins.dra.controlplane import add_node, control_plane  # noqa: E402

TYPED = ("from kubernetes import client, config\n"
         "api = client.CoreV1Api(config.new_client_from_config(config_file=K))\n"
         "nodes = [(n.metadata.name, n.status.capacity) for n in api.list_node().items]\n")
PLAIN = ("from sandbox.kubeapi import Kube\n"
         "with Kube.from_kubeconfig(K) as api:\n"
         "    nodes = [(n['metadata']['name'], n['status'].get('capacity'))\n"
         "             for n in api.items('/api/v1/nodes')]\n")


def once(code: str, kubeconfig: Path) -> tuple[float, float]:
    """CPU and wall seconds of a fresh ``python -c`` running ``code``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", f"K = {str(kubeconfig)!r}\n{code}"], check=True,
                   cwd=REPO)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    with control_plane() as cp:
        add_node(cp.api(), "dra-worker")
        runs: dict[str, list[tuple[float, float]]] = {"typed": [], "plain": []}
        for _ in range(args.rounds):
            runs["typed"].append(once(TYPED, cp.kubeconfig))
            runs["plain"].append(once(PLAIN, cp.kubeconfig))
    cpu = {k: statistics.median(c for c, _ in v) for k, v in runs.items()}
    wall = {k: statistics.median(w for _, w in v) for k, v in runs.items()}
    print(f"list the nodes from a fresh process, median of {args.rounds} rounds")
    print("| client | CPU | wall | CPU ratio | wall ratio |")
    print("|---|---|---|---|---|")
    for k, label in (("typed", "kubernetes CoreV1Api (baseline)"), ("plain", "sandbox.kubeapi")):
        print(f"| {label} | {cpu[k]:.3f} s | {wall[k]:.3f} s | {cpu[k] / cpu['typed']:.2f} | "
              f"{wall[k] / wall['typed']:.2f} |")


if __name__ == "__main__":
    main()
