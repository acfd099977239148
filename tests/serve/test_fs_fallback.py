"""The FUSE server without its no-open fast mode: every open a round trip, as before it.

The fast mode needs pyfuse3 built with our patch; without it, or with
``HWSANDBOX_FUSE_FAST=0``, the server serves in the old mode (sandbox/fakehw/serve/fs.py). These
tests mount the toy tree (tests/support/fakehw_toy.py) in that mode, with kernel caches warm, and
check that the whole mount equals a fresh render before and after a health fault and an
unplug/plug, and that the mode really is the old one: the readdir offsets the kernel
passes on from the server (``d_off``) are positions in a listing taken at OPENDIR (1, 2,
...); in the fast mode, which has no OPENDIR, they carry a listing number in their high
bits. The server says once why it runs without the fast mode only when the patch is
missing (the README and fs.py say so); ``HWSANDBOX_FUSE_FAST=0`` is the user's own choice
and gets no such warning. The patch missing is had by running the same server with
pyfuse3's patch marker (``pyfuse3.HWSANDBOX_PATCH``, what ``FAST_MODE_AVAILABLE`` reads)
deleted before our code is imported: what a stock pyfuse3 looks like to it.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import pytest

from sandbox.fakehw.control import ControlClient
from sandbox.fakehw.serve.fs import FAST_MODE_AVAILABLE
from sandbox.fakehw.tree import DeviceState, Health, Reason
from tests.serve.test_fs_live import GPU0, snapshot_mount, snapshot_tree
from tests.support.fakehw_toy import Server, rebuild, start_server

pytestmark = [pytest.mark.root, pytest.mark.fuse]

WARNING = "lacks hw-sandbox's patch: serving without the no-open fast mode"
# Runs `python -m fakehw_serve ...` (start_server's command, after this wrapper) with a
# pyfuse3 that has no patch marker. argv here: ['-c', PYTHON, '-m', 'fakehw_serve', ...].
_UNPATCHED = (
    "import runpy, sys, pyfuse3\n"
    "vars(pyfuse3).pop('HWSANDBOX_PATCH', None)\n"
    "sys.argv = ['fakehw_serve', *sys.argv[4:]]\n"
    "runpy.run_module('fakehw_serve', run_name='__main__', alter_sys=True)\n"
)


class _Dirent(ctypes.Structure):
    """glibc's ``struct dirent`` on 64-bit Linux."""

    _fields_ = [("d_ino", ctypes.c_uint64), ("d_off", ctypes.c_int64),
                ("d_reclen", ctypes.c_ushort), ("d_type", ctypes.c_ubyte),
                ("d_name", ctypes.c_char * 256)]  # fmt: skip


def dir_offsets(path: Path) -> dict[str, int]:
    """Each entry of a directory listing and its ``d_off`` (readdir(3))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.opendir.restype = ctypes.c_void_p
    libc.opendir.argtypes = [ctypes.c_char_p]
    libc.readdir.restype = ctypes.POINTER(_Dirent)
    libc.readdir.argtypes = [ctypes.c_void_p]
    libc.closedir.argtypes = [ctypes.c_void_p]
    d = libc.opendir(os.fsencode(path))
    if not d:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    try:
        out = {}
        while ent := libc.readdir(d):
            out[ent.contents.d_name.decode()] = ent.contents.d_off
        return out
    finally:
        libc.closedir(d)


def _old_mode_offsets(root: Path) -> None:
    offsets = dir_offsets(root / "sys/class/drm")
    assert set(offsets) - {".", ".."} == {"card0", "card1", "card2"}
    assert max(offsets.values()) < 1 << 32, offsets  # positions: a listing from OPENDIR


def _faults_are_served(srv: Server) -> None:
    """The mount equals a fresh render before and after each fault."""
    root = srv.root
    assert snapshot_mount(root) == snapshot_tree(rebuild({}))  # warms every kernel cache
    aer = root / GPU0 / "aer_dev_fatal"
    assert aer.read_bytes().endswith(b"TOTAL_ERR_FATAL 0\n")
    sick = DeviceState(health=Health.UNHEALTHY, reason=Reason.AER_FATAL)
    with ControlClient(srv.socket) as c:
        c.health("gpu0", "unhealthy", "aer-fatal")
        assert aer.read_bytes().endswith(b"TOTAL_ERR_FATAL 1\n")  # the old page is gone
        assert snapshot_mount(root) == snapshot_tree(rebuild({"gpu0": sick}))
        c.unplug("gpu1")
        assert "card1" not in [p.name for p in (root / "dev/dri").iterdir()]
        gone = {"gpu0": sick, "gpu1": DeviceState(plugged=False)}
        assert snapshot_mount(root) == snapshot_tree(rebuild(gone))
        c.plug("gpu1")
        c.health("gpu0", "healthy")
    assert snapshot_mount(root) == snapshot_tree(rebuild({}))


def test_fast_mode_off_serves_the_tree_and_faults(
    tmp_path: Path, request: pytest.FixtureRequest, capfd: pytest.CaptureFixture[str]
) -> None:
    srv = start_server(tmp_path / "root", wrapper=["env", "HWSANDBOX_FUSE_FAST=0"])
    request.addfinalizer(srv.cleanup)
    _old_mode_offsets(srv.root)
    _faults_are_served(srv)
    assert srv.unmount() == 0
    err = capfd.readouterr().err
    # Nothing is missing where the patch is installed; where it is not, that is said once.
    assert err.count(WARNING) == (0 if FAST_MODE_AVAILABLE else 1), err


def test_without_the_patch_the_server_says_so_once_and_serves(
    tmp_path: Path, request: pytest.FixtureRequest, capfd: pytest.CaptureFixture[str]
) -> None:
    srv = start_server(tmp_path / "root", wrapper=[sys.executable, "-c", _UNPATCHED])
    request.addfinalizer(srv.cleanup)
    _old_mode_offsets(srv.root)
    _faults_are_served(srv)
    assert srv.unmount() == 0
    err = capfd.readouterr().err
    assert err.count(WARNING) == 1, err
    assert "scripts/build-pyfuse3" in err  # and how to get the fast mode


def test_offsets_tell_the_modes_apart(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The probe above, against the fast mode (the default where the patch is installed)."""
    assert FAST_MODE_AVAILABLE, (
        "pyfuse3 lacks hw-sandbox's patch (no FUSE fast mode): run "
        'scripts/build-pyfuse3 "$(command -v python)" in this environment'
    )
    env = os.environ.get("HWSANDBOX_FUSE_FAST")
    srv = start_server(tmp_path / "root", wrapper=["env", "HWSANDBOX_FUSE_FAST=1"])
    request.addfinalizer(srv.cleanup)
    offsets = dir_offsets(srv.root / "sys/class/drm")
    assert min(v for k, v in offsets.items() if k.startswith("card")) >= 1 << 32, (env, offsets)
    assert srv.unmount() == 0
