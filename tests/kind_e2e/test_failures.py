"""Failure paths of `sandbox up --runtime kind`: each is one line naming the step and what
to do, with no traceback, and nothing is left behind."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from tests.kind_e2e.conftest import REPO, STATE_ROOT, KindEnv, host_footprint, leftovers

NAME = "hwsb-e2e-fail"
PROFILE = str(REPO / "profiles" / "8gpu-2numa.yaml")


def _up_fails(kind_env: KindEnv, env: dict[str, str], *extra: str, step: str) -> str:
    """``sandbox up`` fails at ``step`` with one ``error:`` line and, unless ``--retain``,
    leaves nothing behind (no container, network, state, new mount or volume)."""
    before = host_footprint()
    proc = kind_env.sandbox("up", PROFILE, "--runtime", "kind", "--name", NAME, *extra,
                            check=False, env=env)
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: sandbox up failed at step '{step}': "), proc.stderr
    if "--retain" not in extra:
        assert leftovers(NAME, before) == [], leftovers(NAME, before)
    return last


def test_no_docker(kind_env: KindEnv) -> None:
    env = dict(kind_env.env, DOCKER_HOST="unix:///run/hwsb-kind-e2e-no-such-docker.sock")
    last = _up_fails(kind_env, env, step="preflight")
    assert "no Docker daemon reachable" in last, last
    assert "dockerd" in last, last


def test_docker_without_kind(kind_env: KindEnv, tmp_path: Path) -> None:
    path = ":".join(p for p in kind_env.env["PATH"].split(":")
                    if not os.path.exists(os.path.join(p, "kind")))
    # The test tooling built kind into the project cache: say where it is.
    last = _up_fails(kind_env, dict(kind_env.env, PATH=path), step="preflight")
    assert "no kind on PATH" in last, last
    assert "tools/kind-v0.32.0:$PATH" in last, last
    # Nowhere to be found: say how to get it.
    last = _up_fails(kind_env, dict(kind_env.env, PATH=path, HWSANDBOX_CACHE=str(tmp_path)),
                     step="preflight")
    assert "no kind on PATH" in last, last
    assert "go install sigs.k8s.io/kind@v0.32.0" in last, last


def test_missing_node_image(kind_env: KindEnv) -> None:
    env = dict(kind_env.env, SANDBOX_KIND_IMAGE="hw-sandbox/no-such-node:v0")
    last = _up_fails(kind_env, env, step="preflight")
    assert "hw-sandbox/no-such-node:v0 is not present locally" in last, last
    assert "scripts/build-kind-node-image" in last, last


@pytest.fixture
def broken_agent_base(kind_env: KindEnv) -> str:
    """An agent base whose Python is gone: the agent pods cannot start."""
    import docker

    from sandbox.images.agent import AGENT_BASE_IMAGE

    ref = "hwsb-e2e/broken-agent-base:latest"
    dockerfile = f"FROM {AGENT_BASE_IMAGE}\nRUN rm -f /usr/bin/python3 /usr/bin/python3.11\n"
    docker.from_env().images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=ref, rm=True)
    return ref


def test_failed_agent_rollout_cleans_up(kind_env: KindEnv, broken_agent_base: str) -> None:
    env = dict(kind_env.env, SANDBOX_AGENT_BASE=broken_agent_base)
    last = _up_fails(kind_env, env, step="agent")
    assert "agent-gpu-worker" in last, last
    assert "--retain" in last, last
    assert not (STATE_ROOT / NAME).exists()


def test_retain_keeps_a_failed_sandbox_for_down(kind_env: KindEnv,
                                                broken_agent_base: str) -> None:
    """With --retain the failed sandbox stays (state, cluster) for debugging, and `sandbox
    down` then removes all of it."""
    env = dict(kind_env.env, SANDBOX_AGENT_BASE=broken_agent_base)
    before = host_footprint()
    try:
        last = _up_fails(kind_env, env, "--retain", step="agent")
        assert "everything it made was removed" not in last, last
        assert (STATE_ROOT / NAME / "kubeconfig").is_file()
        assert any(f.startswith("container ") for f in leftovers(NAME)), leftovers(NAME)
    finally:
        kind_env.sandbox("down", "--name", NAME, env=env)
    assert leftovers(NAME, before) == [], leftovers(NAME, before)
