"""Our kubelet API protos: stubs up to date, and wire-compatible with upstream k8s.io/kubelet.

Upstream's .proto files are never committed: the test downloads the pinned k8s.io/kubelet
module through the Go toolchain (module cache), compiles them with grpcio-tools into a
descriptor set in tmp_path and compares every message, enum and service with ours.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf import descriptor_pb2

from tests.support.paths import REPO

pytestmark = [pytest.mark.network]

API_DIR = REPO / "plugins" / "hwplugins" / "api"
KUBELET_MODULE = "k8s.io/kubelet"
KUBELET_VERSION = "v0.37.2"  # the kubelet we build; has dra/v1 and dra-health/v1 and v1alpha1

# upstream path inside the module -> our generated module
UPSTREAM = {
    "pkg/apis/deviceplugin/v1beta1/api.proto": "deviceplugin_v1beta1",
    "pkg/apis/pluginregistration/v1/api.proto": "pluginregistration_v1",
    "pkg/apis/dra/v1/api.proto": "dra_v1",
    "pkg/apis/dra/v1beta1/api.proto": "dra_v1beta1",
    "pkg/apis/dra-health/v1/api.proto": "drahealth_v1",
    "pkg/apis/dra-health/v1alpha1/api.proto": "drahealth_v1alpha1",
    "pkg/apis/podresources/v1/api.proto": "podresources_v1",
}


def _go() -> str:
    for candidate in (shutil.which("go"), "/usr/local/go/bin/go"):
        if candidate and Path(candidate).exists():
            return candidate
    pytest.fail(
        "needs the Go toolchain to fetch k8s.io/kubelet: install Go from https://go.dev/dl/"
    )


def _grpc_protoc() -> ModuleType:
    try:
        return importlib.import_module("grpc_tools.protoc")
    except ImportError:
        pytest.fail("needs grpcio-tools: pip install 'hw-sandbox[test]' (or grpcio-tools)")


@pytest.fixture(scope="module")
def upstream_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("gomod")
    proc = subprocess.run(
        [_go(), "mod", "download", "-json", f"{KUBELET_MODULE}@{KUBELET_VERSION}"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    info = json.loads(proc.stdout or "{}")
    if proc.returncode != 0 or "Dir" not in info:
        pytest.fail(
            f"go mod download {KUBELET_MODULE}@{KUBELET_VERSION} failed (needs the Go module "
            f"proxy, GOPROXY):\n{info.get('Error', '')}{proc.stderr}"
        )
    return Path(info["Dir"])


_GOGO_IMPORT = re.compile(r'^\s*import\s+"github\.com/gogo/[^"]*";\s*$', re.M)
_GOGO_OPTION = re.compile(r"^\s*option\s+\(gogoproto\.[^;]*;\s*$", re.M)
_GOGO_FIELD_OPTS = re.compile(r"\s*\[\s*\(gogoproto\.[^\]]*\]")


def _strip_gogo(text: str) -> str:
    """Older kubelet protos import gogo.proto for Go codegen only; it changes no wire facts."""
    return _GOGO_FIELD_OPTS.sub("", _GOGO_OPTION.sub("", _GOGO_IMPORT.sub("", text)))


@pytest.fixture(scope="module")
def upstream_files(
    upstream_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    protoc = _grpc_protoc()
    src = tmp_path_factory.mktemp("upstream")
    for rel in UPSTREAM:
        dest = src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(_strip_gogo((upstream_dir / rel).read_text()))
    out = src / "upstream.pb"
    argv = ["protoc", f"--proto_path={src}", f"--descriptor_set_out={out}", *UPSTREAM]
    assert protoc.main(argv) == 0, f"protoc failed on upstream files: {argv}"
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return {f.name: f for f in fds.file}


def _ours(module: str) -> descriptor_pb2.FileDescriptorProto:
    mod = importlib.import_module(f"hwplugins.api.{module}_pb2")
    proto = descriptor_pb2.FileDescriptorProto()
    mod.DESCRIPTOR.CopyToProto(proto)
    return proto


def _shape(fdp: descriptor_pb2.FileDescriptorProto) -> dict[str, object]:
    """Everything that decides the wire format and the RPC paths, nothing cosmetic."""
    shape: dict[str, object] = {"package": fdp.package}

    def walk(msgs: list[descriptor_pb2.DescriptorProto], prefix: str) -> None:
        for m in msgs:
            name = f"{prefix}.{m.name}"
            shape[f"message {name}"] = {
                f.name: (
                    f.number,
                    descriptor_pb2.FieldDescriptorProto.Type.Name(f.type),
                    descriptor_pb2.FieldDescriptorProto.Label.Name(f.label),
                    f.type_name,
                    f.proto3_optional,
                    m.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None,
                )
                for f in m.field
            }
            shape[f"map_entry {name}"] = m.options.map_entry
            walk(list(m.nested_type), name)
            for e in m.enum_type:
                shape[f"enum {name}.{e.name}"] = {v.name: v.number for v in e.value}

    walk(list(fdp.message_type), f".{fdp.package}")
    for e in fdp.enum_type:
        shape[f"enum .{fdp.package}.{e.name}"] = {v.name: v.number for v in e.value}
    for s in fdp.service:
        shape[f"service {fdp.package}.{s.name}"] = {
            m.name: (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
            for m in s.method
        }
    return shape


@pytest.mark.parametrize(("upstream", "module"), sorted(UPSTREAM.items()))
def test_matches_upstream(
    upstream_files: dict[str, descriptor_pb2.FileDescriptorProto], upstream: str, module: str
) -> None:
    theirs, ours = _shape(upstream_files[upstream]), _shape(_ours(module))
    assert sorted(ours) == sorted(theirs), f"{module}: different set of messages/services"
    for key in sorted(theirs):
        assert ours[key] == theirs[key], f"{module}: {key} differs from {upstream}"


def test_every_proto_is_checked_against_upstream() -> None:
    ours = sorted(p.stem for p in API_DIR.glob("*.proto"))
    assert ours == sorted(UPSTREAM.values())


def test_generated_stubs_are_up_to_date(tmp_path: Path) -> None:
    _grpc_protoc()
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen-protos"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    fresh_dir = tmp_path / "hwplugins" / "api"
    fresh = sorted(p.name for p in fresh_dir.iterdir())
    committed = sorted(p.name for p in API_DIR.glob("*_pb2*.py*"))
    assert fresh == committed, "run scripts/gen-protos: set of generated files differs"
    for name in fresh:
        assert (fresh_dir / name).read_bytes() == (API_DIR / name).read_bytes(), (
            f"{name} is stale: run scripts/gen-protos with the grpcio-tools that pyproject.toml's"
            " test extra pins (another version writes its own version into the stubs)"
        )


@pytest.mark.parametrize("module", sorted(UPSTREAM.values()))
def test_stubs_import_as_package_modules(module: str) -> None:
    grpc_mod = importlib.import_module(f"hwplugins.api.{module}_pb2_grpc")
    pb2 = importlib.import_module(f"hwplugins.api.{module}_pb2")
    assert pb2.DESCRIPTOR.name == f"hwplugins/api/{module}.proto"
    assert any(name.endswith("Servicer") for name in vars(grpc_mod))
