"""Every file a user names for output goes through one writer (issue 21 item 7).

``sandbox capture -o``, ``sandbox status -o svg|png --file``, ``sandbox dra claims -o
svg|png --file`` and ``sandbox mount --daemon --pid-file``, run as a user runs them (the
real CLI in a subprocess), against real targets: a tmpfs filled to the last byte, FIFOs,
a socket, /dev/null, symbolic links to files outside, directories, missing directories and
''. Every refusal and failure is one ``error:`` line naming the path, exit 1, no
traceback; nothing is left behind and an existing target is untouched. A hang fails the
test (every run has a timeout).

``status`` reads a hand-written sandbox record (``HWSANDBOX_STATE_DIR``, no nodes: the
picture is the profile's); ``dra claims --kubeconfig`` reads an HTTP server in this process
that serves the reference driver's own ResourceSlices for a shipped profile.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandbox.agent import unmount
from sandbox.draconfig import node_slices
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.profile import load_profile, spec
from tests.support.fakehw_toy import require_fuse
from tests.support.paths import REPO

pytestmark = [pytest.mark.root, pytest.mark.fuse]

PROFILE = REPO / "profiles" / "8gpu-2numa.yaml"
TIMEOUT = 30  # a normal run takes about a second; a write blocked on a FIFO never ends

COMMANDS = ("capture", "status-svg", "status-png", "claims-svg", "claims-png")
MAGIC = {"capture": b"# Hardware profile captured", "svg": b"<svg", "png": b"\x89PNG\r\n"}

Run = Callable[..., subprocess.CompletedProcess[str]]


def _magic(command: str) -> bytes:
    return MAGIC[command.rpartition("-")[2]]


# setups ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def machine_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A machine root for ``capture --root``: our render of 8gpu-2numa."""
    root = tmp_path_factory.mktemp("machine") / "root"
    render(build_tree(load_profile(PROFILE).cluster.nodes[0]), root)
    return root


@pytest.fixture(scope="module")
def state_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state root holding one local sandbox record and the spec it came up with (what
    ``sandbox status`` draws), for ``sandbox status``."""
    root = tmp_path_factory.mktemp("state")
    (root / "box").mkdir()
    record = {"runtime": "local", "profile": str(PROFILE), "nodes": {}}
    (root / "box" / "sandbox.json").write_text(json.dumps(record))
    (root / "box" / "spec.json").write_text(spec.dump(load_profile(PROFILE).cluster))
    return root


@pytest.fixture(scope="module")
def kubeconfig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A kubeconfig of an HTTP server that lists the driver's slices for mig-partitions."""
    node = load_profile(REPO / "profiles" / "mig-partitions.yaml").cluster.nodes[0]
    lists = {"resourceslices": node_slices(node), "resourceclaims": []}

    class Api(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            kind = self.path.partition("?")[0].rstrip("/").rpartition("/")[2]
            if kind not in lists:
                self.send_error(404)
                return
            body = json.dumps({"apiVersion": "resource.k8s.io/v1", "kind": "List",
                               "metadata": {}, "items": lists[kind]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    path = tmp_path_factory.mktemp("kube") / "kubeconfig"
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{server.server_address[1]}"}}}}]
users: [{{name: u, user: {{}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    try:
        yield path
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def run(machine_root: Path, state_root: Path, kubeconfig: Path) -> Run:
    """``run(command, target, *extra)``: the CLI writing ``target``, with a timeout."""

    def run(command: str, target: str | Path, *extra: str,
            umask: int = -1) -> subprocess.CompletedProcess[str]:
        verb, _, picture = command.partition("-")
        if verb == "capture":
            args = ["capture", "--root", str(machine_root), "-o", str(target)]
        elif verb == "status":
            args = ["status", "-o", picture, "--file", str(target)]
        else:
            args = ["dra", "claims", "--kubeconfig", str(kubeconfig), "-o", picture,
                    "--file", str(target)]
        env = {**os.environ, "HWSANDBOX_STATE_DIR": str(state_root)}
        return subprocess.run([sys.executable, "-m", "sandbox", *args, *extra], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=TIMEOUT,
                              check=False, umask=umask)

    return run


@pytest.fixture
def full(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (``_fill`` fills it to the last byte); a PNG of 8gpu-2numa is ~75 KiB."""
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root", pytrace=False)
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(mnt)],
                   check=True, timeout=TIMEOUT)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=TIMEOUT)


def _fill(mnt: Path) -> Path:
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with pytest.raises(OSError, match="No space left"):  # noqa: PT012 - until it is full
            while True:
                os.write(fd, b"x" * 4096)
    finally:
        os.close(fd)
    return filler


def _one_line_error(done: subprocess.CompletedProcess[str], *words: str) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: "), done.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# a full filesystem -------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["capture", "status-png", "claims-png"])
def test_a_full_filesystem_leaves_no_file_and_the_retry_works(
        run: Run, full: Path, command: str) -> None:
    filler = _fill(full)
    target = full / "out"
    _one_line_error(run(command, target), str(target), "No space left on device")
    assert sorted(os.listdir(full)) == ["filler"]  # no empty file, no temporary file
    filler.unlink()
    again = run(command, target)  # no --force needed: nothing was left to block it
    assert again.returncode == 0, again.stderr
    assert target.read_bytes().startswith(_magic(command))
    assert sorted(os.listdir(full)) == ["out"]


@pytest.mark.parametrize("command", ["capture", "status-png", "claims-png"])
def test_a_full_filesystem_leaves_the_old_file_as_it_was(
        run: Run, full: Path, command: str) -> None:
    target = full / "out"
    target.write_bytes(b"the old one\n")
    _fill(full)
    _one_line_error(run(command, target, "--force"), str(target), "No space left on device")
    assert target.read_bytes() == b"the old one\n"
    assert sorted(os.listdir(full)) == ["filler", "out"]


# what is not a regular file ----------------------------------------------------------------


def _target(kind: str, tmp_path: Path) -> tuple[Path | str, list[str], Callable[[], None]]:
    """The target of case ``kind``, the words its error must hold, and a check (asserts)
    that nothing was written or changed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / "precious"
    precious.write_bytes(b"precious\n")
    here = tmp_path / "here"
    here.mkdir()
    out = here / "out"
    also: list[Callable[[], bool]] = []

    def check() -> None:
        assert precious.read_bytes() == b"precious\n"
        assert os.listdir(outside) == ["precious"]
        for more in also:
            assert more(), kind

    if kind == "directory":
        out.mkdir()
        also += [lambda: os.listdir(out) == [], lambda: os.listdir(here) == ["out"]]
        return out, [str(out), "is a directory"], check
    if kind.startswith("fifo"):
        os.mkfifo(out)
        also += [lambda: stat.S_ISFIFO(out.lstat().st_mode), lambda: os.listdir(here) == ["out"]]
        return out, [str(out), "FIFO"], check
    if kind.startswith("symlink"):
        out.symlink_to(precious)
        also += [out.is_symlink, lambda: os.listdir(here) == ["out"]]
        return out, [str(out), "symbolic link"], check
    if kind.startswith("dangling-symlink"):
        out.symlink_to(outside / "new")
        also += [out.is_symlink, lambda: os.listdir(here) == ["out"]]
        return out, [str(out), "symbolic link"], check
    if kind == "missing-directory":
        parent = here / "nowhere"
        also += [lambda: os.listdir(here) == []]
        return parent / "out", [str(parent / "out"), str(parent), "does not exist"], check
    if kind == "parent-is-a-file":
        parent = here / "file"
        parent.write_bytes(b"a file\n")
        also += [lambda: parent.read_bytes() == b"a file\n", lambda: os.listdir(here) == ["file"]]
        return parent / "out", [str(parent / "out"), f"{parent} is not a directory"], check
    if kind == "empty":
        return "", ["empty"], check
    if kind.startswith("device"):
        return "/dev/null", ["/dev/null", "character device"], check
    raise AssertionError(kind)


KINDS = ("directory", "fifo", "fifo --force", "symlink", "symlink --force",
         "dangling-symlink --force", "missing-directory", "parent-is-a-file", "empty",
         "device --force")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_target_that_is_not_a_new_or_regular_file_is_refused(
        run: Run, tmp_path: Path, command: str, kind: str) -> None:
    target, words, check = _target(kind, tmp_path)
    extra = ["--force"] if kind.endswith("--force") else []
    _one_line_error(run(command, target, *extra), *words)
    check()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_socket_is_refused(run: Run, command: str) -> None:
    short = Path(tempfile.mkdtemp(prefix="hwsb-"))  # a socket path is at most 107 bytes
    try:
        target = short / "sock"
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(str(target))
            _one_line_error(run(command, target, "--force"), str(target), "socket")
        assert stat.S_ISSOCK(target.lstat().st_mode)
    finally:
        shutil.rmtree(short)


# existing regular files --------------------------------------------------------------------


@pytest.mark.parametrize("command", ["status-svg", "status-png", "claims-svg", "claims-png"])
def test_an_existing_file_needs_force(run: Run, tmp_path: Path, command: str) -> None:
    target = tmp_path / "mine"
    target.write_bytes(b"mine\n")
    _one_line_error(run(command, target), str(target), "exists", "--force")
    assert target.read_bytes() == b"mine\n"
    assert os.listdir(tmp_path) == ["mine"]


@pytest.mark.parametrize("command", COMMANDS)
def test_force_replaces_the_file_by_a_rename(run: Run, tmp_path: Path, command: str) -> None:
    """The new file is a new inode renamed over the old name (a hard link to the old file
    keeps the old bytes), its mode 0666 less the umask, and nothing else is left."""
    target = tmp_path / "out"
    target.write_bytes(b"mine\n")
    os.link(target, tmp_path / "alias")
    done = run(command, target, "--force", umask=0o002)
    assert done.returncode == 0, done.stderr
    assert target.read_bytes().startswith(_magic(command))
    assert (tmp_path / "alias").read_bytes() == b"mine\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o664
    assert sorted(os.listdir(tmp_path)) == ["alias", "out"]


@pytest.mark.parametrize("verb", [["status"], ["dra", "claims"]])
def test_help_tells_of_force(verb: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "sandbox", *verb, "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr
    assert "--force" in done.stdout
    assert "--file" in done.stdout


# mount --pid-file --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["directory", "symlink"])
def test_a_bad_pid_file_is_refused_before_anything_is_mounted(tmp_path: Path,
                                                              kind: str) -> None:
    """The pid file is checked before the server starts: a refusal leaves no mount and no
    server behind (it used to start the server, then fail to write the pid)."""
    require_fuse()
    target, words, check = _target(kind, tmp_path)
    root = tmp_path / "root"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "sandbox", "mount", str(PROFILE), str(root), "--node",
             "gpu-worker", "--daemon", "--state-dir", str(tmp_path / "state"),
             "--pid-file", str(target)],
            cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT, check=False)
        _one_line_error(done, *words)
        check()
        assert not os.path.ismount(root)
    finally:
        if os.path.ismount(root):
            unmount(root)
