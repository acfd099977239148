"""sandbox/runtimes/native/cleanup.py: `down` removes the kubelet root `up` made (our marker
in it) with whatever is still mounted below it, and says what it could not remove instead
of leaving it in silence (a CI run once found /var/lib/kubelet after a `down`, and the next
native `up` took it for a root not its own). Here on a scratch directory with real mounts;
tests/e2e/test_native.py::test_down_leaves_nothing_behind does it to a real cluster."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.runtimes.native.cleanup import CREATED_MARKER, mounts_below, remove_own_dir
from tests.support.readers import need

pytestmark = [pytest.mark.root]  # real mounts


def _kubelet_root(tmp_path: Path) -> Path:
    root = tmp_path / "kubelet"
    volume = root / "pods" / "uid" / "volumes" / "kubernetes.io~projected" / "token"
    volume.mkdir(parents=True)
    (root / CREATED_MARKER).write_text("made by `sandbox up --runtime native`\n")
    subprocess.run(["mount", "--bind", str(root), str(root)], check=True)  # as up shares it
    subprocess.run(["mount", "-t", "tmpfs", "hwsb-test", str(volume)], check=True)
    (volume / "token").write_text("secret\n")
    return root


@pytest.fixture
def kubelet_root(tmp_path: Path) -> Iterator[Path]:
    root = _kubelet_root(tmp_path)
    yield root
    for point in mounts_below(root):
        subprocess.run(["umount", "-l", point], check=False)
    subprocess.run(["chattr", "-i", str(root / "pinned")], check=False, capture_output=True)


def test_the_root_goes_with_its_mounts(kubelet_root: Path) -> None:
    assert len(mounts_below(kubelet_root)) == 2
    assert remove_own_dir(kubelet_root) == []
    assert not kubelet_root.exists()
    assert mounts_below(kubelet_root.parent) == []


def test_what_cannot_be_removed_is_reported(kubelet_root: Path) -> None:
    pinned = kubelet_root / "pinned"
    pinned.write_text("")
    subprocess.run([need("chattr"), "+i", str(pinned)], check=True)  # unlink: EPERM, even as root
    problems = remove_own_dir(kubelet_root, attempts=2, pause=0)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{kubelet_root} (made by up) remains (Directory not "
                                  "empty): mounts below it: none; 1 entries ['pinned']"), problems
