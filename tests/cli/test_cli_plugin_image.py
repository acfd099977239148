"""A plugin author's own image in a sandbox (issue 25): `sandbox plugins template` (the
manifest, from plugins/manifests/template-*.yaml) and `sandbox load`'s refusals, through
the installed console script. The template applied to a real API server:
tests/e2e/test_manifests_dry_run.py; loaded and run in kind: tests/kind_e2e/test_kind.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sandbox.manifests import PLUGINS
from tests.support.cli import REPO, _env, sandbox, state_roots
from tests.support.fakehw_toy import require_fuse

IMAGE = "registry.example.com/acme/gpu_plugin:v1.2"
TREE = "/var/lib/hw-sandbox/root"


def _docs(*args: str) -> list[dict[str, Any]]:
    out = sandbox("plugins", "template", *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    assert doc["kind"] == "DaemonSet"
    spec: dict[str, Any] = doc["spec"]["template"]["spec"]
    return spec


def _mounts(doc: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """mountPath -> (the volume's hostPath, the mount)."""
    pod = _pod(doc)
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    [container] = pod["containers"]
    return {m["mountPath"]: (host[m["name"]], m) for m in container["volumeMounts"]}


def test_device_plugin_template() -> None:
    [ds] = _docs("--image", IMAGE, "--command", "/usr/bin/my-plugin",
                 "--args=-v 5", "--args", "--root /hw-sandbox/root 'two words'")
    assert ds["metadata"] == {"name": "gpu-plugin", "namespace": "kube-system",
                              "labels": {"app.kubernetes.io/name": "gpu-plugin"}}
    assert ds["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "gpu-plugin"}
    pod = _pod(ds)
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] \
        == {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "hwsandbox.dev/node", "operator": "Exists"}]}]}
    assert pod["tolerations"] == [{"operator": "Exists"}]
    [c] = pod["containers"]
    assert c["image"] == IMAGE
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert c["command"] == ["/usr/bin/my-plugin"]
    assert c["args"] == ["-v", "5", "--root", "/hw-sandbox/root", "two words"]
    assert not c["terminationMessagePath"].startswith("/dev/")
    mounts = _mounts(ds)
    assert set(mounts) == {"/sys", "/dev", "/hw-sandbox/root", "/var/lib/kubelet/device-plugins"}
    assert mounts["/sys"][0] == f"{TREE}/sys"
    assert mounts["/hw-sandbox/root"][0] == TREE
    assert mounts["/dev"][0] == "/dev"  # the node's, with the agent's stand-in nodes
    assert mounts["/var/lib/kubelet/device-plugins"][0] == "/var/lib/kubelet/device-plugins"
    for path in ("/sys", "/hw-sandbox/root"):  # the FUSE mount shows inside the pod
        assert mounts[path][1]["mountPropagation"] == "HostToContainer", path
    assert mounts["/hw-sandbox/root"][1]["readOnly"] is True


def test_template_uses_the_bundled_manifests_tree_paths() -> None:
    """The fake tree's hostPaths are the ones the bundled manifests mount (what the kind
    agent serves and `sandbox plugins deploy` links on native)."""
    bundled = set()
    for plugin in PLUGINS:
        for doc in yaml.safe_load_all(plugin.text()):
            for volume in (doc or {}).get("spec", {}).get("template", {}).get(
                    "spec", {}).get("volumes", []):
                path = volume.get("hostPath", {}).get("path", "")
                if path.startswith("/var/lib/hw-sandbox/"):
                    bundled.add(path)
    for args in ((), ("--dra",)):
        docs = _docs("--image", IMAGE, *args)
        used = {host for host, _ in _mounts(docs[-1]).values()
                if host.startswith("/var/lib/hw-sandbox/")}
        assert used == {TREE, f"{TREE}/sys"}
        assert used <= bundled, (used, bundled)


def test_image_entrypoint_when_no_command() -> None:
    out = sandbox("plugins", "template", "--image", "my-plugin", "--name", "mine",
                  "--namespace", "plugins")
    assert out.returncode == 0, out.stderr
    assert "# command: []   # not set (--command): the image's ENTRYPOINT runs" in out.stdout
    assert "__" not in "".join(line for line in out.stdout.splitlines()
                               if not line.lstrip().startswith("#"))
    [ds] = yaml.safe_load_all(out.stdout)
    assert (ds["metadata"]["name"], ds["metadata"]["namespace"]) == ("mine", "plugins")
    [c] = _pod(ds)["containers"]
    assert "command" not in c
    assert "args" not in c
    assert c["image"] == "my-plugin"


def test_dra_template() -> None:
    docs = _docs("--image", "acme/gpu-dra:dev", "--dra", "--namespace", "dra")
    assert [d["kind"] for d in docs] == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                         "DaemonSet"]
    sa, role, binding, ds = docs
    assert sa["metadata"]["namespace"] == "dra"
    assert sa["metadata"]["name"] == "gpu-dra"
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert {"resourceslices", "resourceclaims", "resourceclaims/status"} <= resources
    assert binding["roleRef"]["name"] == "gpu-dra"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-dra",
                                    "namespace": "dra"}]
    assert _pod(ds)["serviceAccountName"] == "gpu-dra"
    mounts = _mounts(ds)
    for path in ("/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins",
                 "/var/run/cdi"):
        assert mounts[path][0] == path
    assert mounts["/sys"][0] == f"{TREE}/sys"
    assert mounts["/dev"][0] == "/dev"


@pytest.mark.parametrize(("args", "message"), [
    (("--name", "Bad_Name"), "error: invalid name 'Bad_Name': use a DNS-1123 label "
     "(lowercase letters, digits and '-', starting and ending with a letter or digit, at "
     "most 63 characters)"),
    (("--name", "x" * 64), f"error: invalid name '{'x' * 64}': use a DNS-1123 label"),
    (("--name", "my.plugin"), "error: invalid name 'my.plugin': use a DNS-1123 label"),
    (("--namespace", "kube system"), "error: invalid namespace 'kube system': use a "
     "DNS-1123 label"),
])
def test_name_refused(args: tuple[str, ...], message: str) -> None:
    out = sandbox("plugins", "template", "--image", IMAGE, *args)
    assert (out.returncode, out.stdout) == (1, "")
    [line] = out.stderr.splitlines()  # one line, no traceback
    assert line.startswith(message), line


@pytest.mark.parametrize(("image", "message"), [
    ("bad image", "error: invalid image reference 'bad image': give one like "
     "registry.example.com/team/my-plugin:v1 or my-plugin:dev"),
    ("___:1", "error: cannot make a name from the image '___:1': give --name"),
])
def test_image_refused(image: str, message: str) -> None:
    out = sandbox("plugins", "template", "--image", image)
    assert (out.returncode, out.stderr.strip()) == (1, message)


def test_output_file(tmp_path: Path) -> None:
    target = tmp_path / "plugin.yaml"
    printed = sandbox("plugins", "template", "--image", IMAGE).stdout
    out = sandbox("plugins", "template", "--image", IMAGE, "-o", str(target))
    assert out.returncode == 0, out.stderr
    assert target.read_text() == printed
    assert f"sandbox plugins deploy {target}" in out.stderr
    again = sandbox("plugins", "template", "--image", "other:1", "-o", str(target))
    assert (again.returncode, again.stderr.strip()) == (
        1, f"error: {target}: exists; pass --force to overwrite it")
    assert target.read_text() == printed
    forced = sandbox("plugins", "template", "--image", "other:1", "-o", str(target), "--force")
    assert forced.returncode == 0, forced.stderr
    assert "image: \"other:1\"" in target.read_text()


@pytest.mark.parametrize(("args", "message"), [
    ((), "error: nothing to load: name an IMAGE, or an archive with --archive FILE.tar"),
    (("--archive", "/nonexistent/plugin.tar"),
     "error: /nonexistent/plugin.tar: no such image archive"),
    (("--archive", str(REPO)), f"error: {REPO}: is a directory, not an image archive"),
])
def test_load_argument_errors(args: tuple[str, ...], message: str, tmp_path: Path) -> None:
    out = sandbox("load", *args, env=_env(tmp_path))
    assert (out.returncode, out.stderr.strip()) == (1, message)


def test_load_without_a_sandbox(tmp_path: Path) -> None:
    out = sandbox("load", "acme/plugin:v1", env=_env(tmp_path))
    assert (out.returncode, out.stderr.strip()) == (
        1, "error: no sandbox is running; start one with `sandbox up PROFILE`")
    named = sandbox("load", "acme/plugin:v1", "--name", "Nope", env=_env(tmp_path))
    assert named.returncode == 1
    assert named.stderr.startswith("error: invalid sandbox name 'Nope'"), named.stderr


@pytest.fixture
def state_root() -> Iterator[Path]:
    yield from state_roots()


@pytest.mark.root
@pytest.mark.fuse
def test_local_runtime_refuses_load_and_deploy(state_root: Path, tmp_path: Path) -> None:
    """The local runtime runs no containers: `sandbox load` and deploying the template say
    so in one line, and nothing of the sandbox changes."""
    require_fuse()
    env = _env(state_root)
    up = sandbox("up", "8gpu-2numa", "--runtime", "local", env=env)
    assert up.returncode == 0, up.stderr
    archive = tmp_path / "plugin.tar"
    archive.write_bytes(b"")
    for args in (("acme/plugin:v1",), ("--archive", str(archive))):
        out = sandbox("load", *args, env=env)
        assert (out.returncode, out.stderr.strip()) == (
            1, "error: sandbox '8gpu-2numa' runs the local runtime, which runs no containers "
            "(its device plugin and kubelet harness are host processes): there is nothing "
            "to load an image into; bring one up with --runtime kind or --runtime native")
    manifest = tmp_path / "plugin.yaml"
    assert sandbox("plugins", "template", "--image", "acme/plugin:v1", "-o",
                   str(manifest)).returncode == 0
    deploy = sandbox("plugins", "deploy", str(manifest), env=env)
    assert (deploy.returncode, deploy.stderr.strip()) == (
        1, "error: sandbox '8gpu-2numa' runs the local runtime, which has no API server to "
        "deploy to; use --runtime native or kind")
    status = sandbox("status", env=env)
    assert status.returncode == 0, status.stderr
    assert sandbox("down", env=env).returncode == 0


def test_deploy_refuses_a_missing_or_empty_file(tmp_path: Path) -> None:
    missing = sandbox("plugins", "deploy", str(tmp_path / "none.yaml"), env=_env(tmp_path))
    assert (missing.returncode, missing.stderr.strip()) == (
        1, f"error: {tmp_path / 'none.yaml'}: cannot read the manifest: No such file or "
        "directory")
    empty = sandbox("plugins", "deploy", "-", stdin="", env=_env(tmp_path))
    assert (empty.returncode, empty.stderr.strip()) == (1, "error: -: the manifest is empty")
