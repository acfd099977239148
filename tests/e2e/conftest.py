"""End-to-end fixtures: a real single-node Kubernetes (the ``native`` runtime).

The cluster is brought up once per session from ``profiles/8gpu-2numa.yaml`` in a
temporary state dir and torn down at the end; ``down`` must leave no process, mount or
device node behind. Missing prerequisites FAIL the tests with the command that fixes them
(``scripts/build-k8s``); nothing is skipped.

Run: ``sudo scripts/build-k8s && sudo tox -e e2e`` (or ``pytest tests/e2e`` as root).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandbox.profile.loader import load_profile
from sandbox.profile.resolve import NodeSpec
from sandbox.runtimes.native import NativeRuntime

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "profiles" / "8gpu-2numa.yaml"


@dataclass
class NativeCluster:
    runtime: NativeRuntime
    state_dir: Path
    node: NodeSpec
    kubeconfig: Path
    core: Any  # kubernetes.client.CoreV1Api
    up_seconds: float


def wait_until(
    what: str,
    check: Callable[[], bool],
    timeout: float = 120.0,
    describe: Callable[[], str] | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}"
                        + (f": {describe()}" if describe else ""))
        time.sleep(0.5)


@pytest.fixture(scope="session")
def native_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeCluster]:
    runtime = NativeRuntime()
    reason = runtime.unavailable_reason()
    if reason is not None:
        pytest.fail(f"native runtime unavailable: {reason}")
    try:
        from kubernetes import client, config
    except ImportError:
        pytest.fail("the kubernetes Python client is missing: pip install -e '.[test]'")
    loaded = load_profile(PROFILE)
    state_dir = tmp_path_factory.mktemp("native") / "state"
    messages: list[str] = []
    start = time.monotonic()
    runtime.up(loaded.cluster, str(PROFILE), state_dir, messages.append)
    up_seconds = time.monotonic() - start
    api_client = config.new_client_from_config(config_file=str(state_dir / "kubeconfig"))
    try:
        yield NativeCluster(
            runtime=runtime,
            state_dir=state_dir,
            node=loaded.cluster.nodes[0],
            kubeconfig=state_dir / "kubeconfig",
            core=client.CoreV1Api(api_client),
            up_seconds=up_seconds,
        )
    finally:
        api_client.close()
        # down removes the state dir; keep the component logs for a failed run.
        keep = tmp_path_factory.mktemp("native-logs")
        shutil.copytree(state_dir / "logs", keep, dirs_exist_ok=True)
        runtime.down(state_dir, messages.append)
    assert not state_dir.exists(), f"down left {state_dir} behind"
