"""sandbox/runtimes/native/hostpaths.py: on the native runtime, `sandbox plugins deploy`
links the node paths the bundled manifests' hostPaths name (/var/lib/hw-sandbox/root,
nvml, driver, features.d) to the sandbox's own directories, and `down` removes them. Here against
a scratch directory in place of /var/lib/hw-sandbox; tests/e2e/test_native_nvidia_manifest.py
does it for real."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from sandbox.cli.plugins import _native_manifest
from sandbox.errors import SandboxError
from sandbox.runtimes.native.hostpaths import (
    LINKS,
    NFD_FEATURES,
    host_links,
    link_host_paths,
    unlink_host_paths,
)
from sandbox.runtimes.record import SandboxRecord, read_record, write_record
from tests.support.paths import REPO


def _sandbox(path: Path) -> Path:
    write_record(path, SandboxRecord(runtime="native", created_paths=("/somewhere/else",)))
    (path / "node-root").mkdir()
    return path


def test_links_made_recorded_and_removed(tmp_path: Path) -> None:
    state, host = _sandbox(tmp_path / "state"), tmp_path / "var-lib" / "hw-sandbox"
    made = link_host_paths(state, host)
    assert {p.name: os.readlink(p) for p in made} == {
        name: str(state / sub) for name, sub in LINKS.items()}  # fmt: skip
    assert (state / "nvml").is_dir()
    assert (state / "features.d").is_dir()
    record = read_record(state)
    assert record is not None
    assert record.created_paths == ("/somewhere/else", str(host))  # down removes it if empty
    assert link_host_paths(state, host) == made  # idempotent, recorded once
    assert read_record(state) == record
    assert host_links(state, host) == sorted(made)

    # another sandbox's links are not this one's
    other = _sandbox(tmp_path / "state2")
    assert host_links(other, host) == []
    unlink_host_paths(other, host)
    assert host_links(state, host) == sorted(made)
    unlink_host_paths(state, host)
    assert list(host.iterdir()) == []


def test_stale_links_replaced_foreign_paths_refused(tmp_path: Path) -> None:
    host = tmp_path / "hw-sandbox"
    host.mkdir()
    (host / "root").symlink_to(tmp_path / "gone" / "node-root")  # a sandbox without its down
    state = _sandbox(tmp_path / "state")
    link_host_paths(state, host)
    assert os.readlink(host / "root") == str(state / "node-root")
    record = read_record(state)
    assert record is not None
    assert record.created_paths == ("/somewhere/else",)  # it was there before

    live = _sandbox(tmp_path / "live")
    with pytest.raises(SandboxError, match="another native sandbox"):
        link_host_paths(live, host)
    unlink_host_paths(state, host)
    (host / "nvml").mkdir()
    with pytest.raises(SandboxError, match="not a link hw-sandbox made"):
        link_host_paths(live, host)


def test_native_deploy_moves_gfd_output_out_of_etc(tmp_path: Path) -> None:
    state = _sandbox(tmp_path / "state")
    text = (REPO / "plugins" / "manifests" / "nvidia-device-plugin.yaml").read_text()
    assert NFD_FEATURES in text
    moved = _native_manifest(text, state)
    docs = list(yaml.safe_load_all(moved))
    paths = [v["hostPath"]["path"] for d in docs
             for v in d["spec"]["template"]["spec"]["volumes"]]  # fmt: skip
    assert NFD_FEATURES not in paths
    assert "/var/lib/hw-sandbox/features.d" in paths
    # only the volume moved: the container still writes where NFD reads; no service
    # account, so no API server address either
    assert docs == [d for d in yaml.safe_load_all(text.replace(
        f"path: {NFD_FEATURES}", "path: /var/lib/hw-sandbox/features.d"))]
    assert _native_manifest("kind: ConfigMap\n", state) == "kind: ConfigMap\n"


def test_native_deploy_gives_a_dra_driver_the_cdi_dir_and_the_api_server(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_record(state, SandboxRecord(runtime="native", host_ip="10.1.2.3",
                                      ports={"apiserver": 16443}))
    text = (REPO / "plugins" / "manifests" / "nvidia-dra-driver.yaml").read_text()
    docs = [d for d in yaml.safe_load_all(_native_manifest(text, state)) if d]
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (cdi,) = [v for v in pod["volumes"] if v["name"] == "cdi"]
    assert cdi["hostPath"]["path"] == str(state / "cdi-plugins")
    (gpus,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in gpus["env"]}
    assert env["KUBERNETES_SERVICE_HOST"] == "10.1.2.3"
    assert env["KUBERNETES_SERVICE_PORT"] == "16443"
    assert env["CDI_ROOT"] == "/var/run/cdi"  # the container's path stays upstream's
    # the other documents are untouched
    assert [d for d in docs if d["kind"] != "DaemonSet"] == \
        [d for d in yaml.safe_load_all(text) if d and d["kind"] != "DaemonSet"]  # fmt: skip
