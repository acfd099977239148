"""The bundled manifest for NVIDIA's device plugin and gpu-feature-discovery
(plugins/manifests/nvidia-device-plugin.yaml): `sandbox plugins list` lists it and
`sandbox plugins show` prints it, header first, and the header explains how it runs
(our NVML through LD_LIBRARY_PATH, docs/nvml.md, kind and native, MIG)."""

from __future__ import annotations

import subprocess
import sys

import yaml

from tests.support.paths import REPO

MANIFEST = REPO / "plugins" / "manifests" / "nvidia-device-plugin.yaml"


def sandbox(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "sandbox", *args], cwd=REPO, text=True,
                            capture_output=True, timeout=60, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def header(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.removeprefix("#").strip())
    return " ".join(lines)


def test_plugins_list_lists_it() -> None:
    rows = [line.split(None, 2) for line in sandbox("plugins", "list").splitlines()]
    (row,) = [r for r in rows if r and r[0] == "nvidia-device-plugin"]
    assert row[1] == "device-plugin"
    assert "through our NVML" in row[2]


def test_plugins_show_prints_the_manifest_and_its_header_explains_it() -> None:
    out = sandbox("plugins", "show", "nvidia-device-plugin")
    assert out == MANIFEST.read_text()
    text = header(out)
    for what in (
        "LD_LIBRARY_PATH=/hwsandbox/nvml",  # how the unmodified dlopen finds our NVML
        "HWSANDBOX_NVML_ROOT",
        "docs/nvml.md",
        "/var/lib/hw-sandbox/nvml",
        "/var/lib/hw-sandbox/root",
        "hwsandbox.dev/node",
        "nvcr.io/nvidia/k8s-device-plugin:v0.18.0",
        "kind:",
        "native:",
        "MIG",
        "aer-fatal: Xid 48",
    ):
        assert what in text, (what, text)
    # what the header says is what the manifest does
    docs = list(yaml.safe_load_all(out))
    assert [d["metadata"]["name"] for d in docs] == ["nvidia-device-plugin",
                                                     "gpu-feature-discovery"]  # fmt: skip
    for doc in docs:
        spec = doc["spec"]["template"]["spec"]
        (ctr,) = spec["containers"]
        assert ctr["image"] == "nvcr.io/nvidia/k8s-device-plugin:v0.18.0"
        env = {e["name"]: e.get("value") for e in ctr["env"]}
        assert env["LD_LIBRARY_PATH"] == "/hwsandbox/nvml"
        assert env["HWSANDBOX_NVML_ROOT"] == "/hwsandbox/root"
        mounts = {m["name"]: m["mountPath"] for m in ctr["volumeMounts"]}
        host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
        assert (mounts["nvml"], host["nvml"]) == ("/hwsandbox/nvml", "/var/lib/hw-sandbox/nvml")
        assert (mounts["root"], host["root"]) == ("/hwsandbox/root", "/var/lib/hw-sandbox/root")
        (term,) = spec["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert term["matchExpressions"] == [{"key": "hwsandbox.dev/node", "operator": "Exists"}]
    plugin_env = {e["name"]: e.get("value") for e in
                  docs[0]["spec"]["template"]["spec"]["containers"][0]["env"]}  # fmt: skip
    assert plugin_env["MIG_STRATEGY"] == "none"
