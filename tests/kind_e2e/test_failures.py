"""Failure paths of `sandbox up --runtime kind`: each is one line naming the step and what
to do, with no traceback, and nothing is left behind."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from tests.kind_e2e.conftest import REPO, STATE_ROOT, KindEnv, leftovers

NAME = "hwsb-e2e-fail"
PROFILE = str(REPO / "profiles" / "8gpu-2numa.yaml")


def _up_fails(kind_env: KindEnv, env: dict[str, str], *extra: str) -> str:
    proc = kind_env.sandbox("up", PROFILE, "--runtime", "kind", "--name", NAME, *extra,
                            check=False, env=env)
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), proc.stderr
    assert leftovers(NAME) == [], leftovers(NAME)
    return last


def test_no_docker(kind_env: KindEnv) -> None:
    env = dict(kind_env.env, DOCKER_HOST="unix:///run/hwsb-kind-e2e-no-such-docker.sock")
    last = _up_fails(kind_env, env)
    assert "no Docker daemon reachable" in last, last
    assert "dockerd" in last, last


def test_docker_without_kind(kind_env: KindEnv, tmp_path: Path) -> None:
    path = ":".join(p for p in kind_env.env["PATH"].split(":")
                    if not os.path.exists(os.path.join(p, "kind")))
    # The test tooling built kind into the project cache: say where it is.
    last = _up_fails(kind_env, dict(kind_env.env, PATH=path))
    assert "no kind on PATH" in last, last
    assert "tools/kind-v0.32.0:$PATH" in last, last
    # Nowhere to be found: say how to get it.
    last = _up_fails(kind_env, dict(kind_env.env, PATH=path, HWSANDBOX_CACHE=str(tmp_path)))
    assert "no kind on PATH" in last, last
    assert "go install sigs.k8s.io/kind@v0.32.0" in last, last


def test_missing_node_image(kind_env: KindEnv) -> None:
    env = dict(kind_env.env, SANDBOX_KIND_IMAGE="hw-sandbox/no-such-node:v0")
    last = _up_fails(kind_env, env)
    assert "hw-sandbox/no-such-node:v0 is not present locally" in last, last
    assert "scripts/build-kind-node-image" in last, last


@pytest.fixture
def broken_agent_base(kind_env: KindEnv) -> str:
    """An agent base whose Python is gone: the agent pods cannot start."""
    import docker

    from sandbox.runtimes.kindimage import AGENT_BASE_IMAGE

    ref = "hwsb-e2e/broken-agent-base:latest"
    dockerfile = f"FROM {AGENT_BASE_IMAGE}\nRUN rm -f /usr/bin/python3 /usr/bin/python3.11\n"
    docker.from_env().images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=ref, rm=True)
    return ref


def test_failed_agent_rollout_cleans_up(kind_env: KindEnv, broken_agent_base: str) -> None:
    env = dict(kind_env.env, SANDBOX_AGENT_BASE=broken_agent_base)
    last = _up_fails(kind_env, env)
    assert "at step 'agent'" in last, last
    assert "agent-gpu-worker" in last, last
    assert "--retain" in last, last
    assert not (STATE_ROOT / NAME).exists()
