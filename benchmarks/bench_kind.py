"""What `sandbox up --runtime kind` adds to a bare `kind create cluster`, in one run.

    baseline   `kind create cluster --config C --wait 180s` with the same node image, the
               same generated config (C: the sandbox's own kind-config.yaml) and the files
               it names (the runc wrapper, the extraMounts' host dirs)
    sandbox    `sandbox up PROFILE --runtime kind`: the same cluster, plus the sandbox
               image (its dependency layer is cached: made once before timing) loaded while
               kubeadm runs, the agent DaemonSet serving the FUSE tree and our device plugin
               (created as soon as the API server answers), and each kubelet restarted on
               the emulated CPUs until it advertises the profile's devices

Target (issue 28): the sandbox adds at most 5 s, median of >= 5 rounds. Rounds alternate
(baseline, sandbox) so load on the machine hits both alike. Needs what the kind e2e tests
need: root, Docker (DOCKER_HOST), kind v0.32.0 and kubectl on PATH, the node image
(scripts/build-kind-node-image).

Run: python benchmarks/bench_kind.py [--profile profiles/8gpu-2numa.yaml] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} failed:\n{proc.stderr}")
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(REPO / "profiles" / "8gpu-2numa.yaml"))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from sandbox.images.deps import deps_layer
    from sandbox.profile import load_profile
    from sandbox.runtimes.kind import KindRuntime, host_facts
    from sandbox.runtimes.kind import topology as kindtopology
    from sandbox.runtimes.kind.config import kind_config_text
    from sandbox.runtimes.kind.host import delete_cluster

    runtime = KindRuntime()
    reason = runtime.unavailable_reason()
    if reason:
        sys.exit(f"kind is not usable here: {reason}")
    image, _present = runtime.node_image()
    import docker

    facts = host_facts(docker.from_env(), image)
    deps_layer(lambda m: print(f"  (warm-up) {m}", file=sys.stderr))
    state_root = Path(tempfile.mkdtemp(prefix="hwsb-bench-kind-", dir="/run"))
    env = dict(os.environ, HWSANDBOX_STATE_DIR=str(state_root))
    cluster = load_profile(args.profile).cluster
    bare_dir = state_root / "bare"
    bare_dir.mkdir()
    config = bare_dir / "kind.yaml"
    # the same document the sandbox generates and the files it names: the extraMounts' host
    # dirs and the runc wrapper containerd's config points at (without it no pod starts)
    kindtopology.install_wrapper(bare_dir)
    config.write_text(kind_config_text(cluster, "hwsb-bench-bare", bare_dir, image, facts))
    for node in cluster.nodes:
        (bare_dir / "nodes" / node.name).mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(bare_dir), str(bare_dir)], check=True)
    subprocess.run(["mount", "--make-rshared", str(bare_dir)], check=True)

    bare: list[float] = []
    ours: list[float] = []
    try:
        for r in range(args.rounds):
            bare.append(timed(["kind", "create", "cluster", "--name", "hwsb-bench-bare",
                               "--config", str(config), "--wait", "180s", "--kubeconfig",
                               str(bare_dir / "kubeconfig")], env))
            delete_cluster("hwsb-bench-bare")  # and its nodes' volumes, as `down` does
            ours.append(timed([sys.executable, "-m", "sandbox", "up", args.profile,
                               "--runtime", "kind", "--name", "hwsb-bench"], env))
            timed([sys.executable, "-m", "sandbox", "down", "--name", "hwsb-bench"], env)
            print(f"round {r + 1}: bare {bare[-1]:.1f}s, sandbox {ours[-1]:.1f}s",
                  file=sys.stderr)
    finally:
        subprocess.run(["umount", "-l", str(bare_dir)], check=False)
        subprocess.run(["rm", "-rf", str(state_root)], check=False)

    b, s = statistics.median(bare), statistics.median(ours)
    print(f"profile {Path(args.profile).name}, node image {image}, {args.rounds} round(s), "
          "median seconds")
    print(f"{'what':<34}{'seconds':>9}{'ratio':>8}")
    print(f"{'kind create cluster (baseline)':<34}{b:>9.1f}{1.0:>8.2f}")
    print(f"{'sandbox up --runtime kind':<34}{s:>9.1f}{s / b:>8.2f}")
    print(f"{'added by the sandbox':<34}{s - b:>9.1f}{'':>8}   target <= 5 s: "
          f"{'met' if s - b <= 5 else 'NOT met'}")
    print(f"rounds: baseline {min(bare):.1f}-{max(bare):.1f} s, sandbox {min(ours):.1f}-"
          f"{max(ours):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
