"""`sandbox up` interrupted (SIGINT at any moment) or raced by `sandbox down` of the same
name: never a traceback, never a sandbox half there. Issue 21, item 11.

Every case runs the real CLI (``python -m sandbox up``, local runtime) in a private state
root. ``up`` runs in a session of its own and is interrupted as a terminal's Ctrl-C
would: SIGINT to its whole process group. The rule these tests hold it to (``sandbox up
--help``): a SIGINT before the ``is up`` line removes everything made so far and ``up``
exits 130 (or dies of the signal itself, before it has made anything: what a shell shows
as 130 too); once that line is printed the sandbox is up, ``up`` only exits (0), and a
SIGINT then leaves the sandbox up until ``sandbox down``. While ``up`` brings a sandbox up
it holds the sandbox's lock: ``sandbox down`` of that name refuses (exit 1, "is coming
up") instead of removing what ``up`` is still making.

Nothing here asserts a duration; the moments are delays from the start of ``up`` and the
progress lines it prints. The interpreter's own start-up, before the first statement of
``sandbox.cli`` hands SIGINT to the process (``site`` and the editable install's path
finder, ``runpy``, the import of ``sandbox.cli`` up to that line: a few tens of ms), is
not ours: a SIGINT that lands there may get Python's own traceback (or its
"init_import_site" fatal error), and only such a traceback is tolerated, nothing made as
always (``python_startup``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.fakehw_toy import require_fuse
from tests.support.paths import REPO as ROOT

pytestmark = [pytest.mark.root, pytest.mark.fuse]

PROFILE = "profiles/8gpu-2numa.yaml"
NAME = "8gpu-2numa"
CLI_INIT = ROOT / "sandbox" / "cli" / "__init__.py"
# the line of sandbox.cli that hands SIGINT to the process (what comes before is Python's;
# without that line, nothing of sandbox.cli is)
GUARD_LINE = next((n for n, line in enumerate(CLI_INIT.read_text().splitlines(), 1)
                   if "_signal.signal(_signal.SIGINT, _signal.SIG_DFL)" in line), 0)


def python_startup(stderr: str) -> bool:
    """Whether ``stderr`` is Python's own report of a SIGINT during its start-up: every
    frame of its traceback is the interpreter's (``site``, ``runpy``, the standard
    library), ``sandbox/__main__.py``'s one import, or ``sandbox.cli`` above the line that
    takes SIGINT over."""
    if "init_import_site" in stderr:  # "Fatal Python error: init_import_site: ..."
        return True
    if "Traceback" not in stderr:
        return False
    for file, line in re.findall(r'File "([^"]+)", line (\d+)', stderr):
        path = Path(file)
        if ROOT / "sandbox" not in path.parents or path == ROOT / "sandbox" / "__main__.py":
            continue
        if path == CLI_INIT and int(line) < GUARD_LINE:
            continue
        return False
    return True


def env_for(state_root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["HWSANDBOX_STATE_DIR"] = str(state_root)
    return env


def cli(state_root: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], cwd=ROOT, text=True,
                          capture_output=True, check=False, env=env_for(state_root),
                          timeout=timeout)


def _unescape(field: str) -> str:
    """A /proc/mounts path field (spaces and the like are octal escapes)."""
    return field.encode().decode("unicode_escape")


def mounts_below(state_root: Path) -> list[str]:
    with open("/proc/mounts") as f:
        points = [_unescape(line.split()[1]) for line in f if line.strip()]
    return [p for p in points if p.startswith(f"{state_root}/")]


def processes_of(state_root: Path) -> dict[int, str]:
    """Every live process whose command line names the state root (ours all do)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
        if str(state_root) in argv:
            out[int(entry)] = argv.strip()
    return out


def leftovers(state_root: Path) -> list[str]:
    """What is left of any sandbox in ``state_root``: any entry, mount or process."""
    found = [f"entry {state_root / n}" for n in sorted(os.listdir(state_root))]
    found += [f"mount {m}" for m in mounts_below(state_root)]
    found += [f"process {pid}: {argv}" for pid, argv in processes_of(state_root).items()]
    return found


def scrub(state_root: Path) -> None:
    """After a test, whatever it left (a failing test must not leak a sandbox): `down`
    of every recorded sandbox, then by hand any process or mount of ours that survived."""
    for record in state_root.glob("*/sandbox.json"):
        cli(state_root, "down", "--name", record.parent.name, timeout=60)
    for pid in processes_of(state_root):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for point in sorted(mounts_below(state_root), key=len, reverse=True):
        subprocess.run(["fusermount3", "-uz", point], capture_output=True, check=False)
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


@pytest.fixture
def state_root() -> Iterator[Path]:
    # gRPC unix socket paths must stay short (105 bytes): no pytest tmp_path here.
    d = Path(tempfile.mkdtemp(prefix="hws-", dir="/tmp"))
    try:
        yield d
    finally:
        scrub(d)
        shutil.rmtree(d, ignore_errors=True)


class RunningUp:
    """``sandbox up`` in a session of its own, its output read as it comes; a callback
    can act on a line the moment it arrives."""

    def __init__(self, state_root: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox", "up", PROFILE, "--runtime", "local", *args],
            cwd=ROOT, env=env_for(state_root), text=True, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True)
        self.lines: dict[str, list[str]] = {"out": [], "err": []}
        self._changed = threading.Condition()
        self._hooks: list[tuple[str, Callable[[], None]]] = []
        self._readers = [threading.Thread(target=self._read, args=(stream, key), daemon=True)
                         for stream, key in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for t in self._readers:
            t.start()

    def _read(self, stream: object, key: str) -> None:
        assert hasattr(stream, "readline")
        for line in iter(stream.readline, ""):
            with self._changed:
                self.lines[key].append(line)
                hooks = [h for h in self._hooks if h[0] in line]
                for h in hooks:
                    self._hooks.remove(h)
                self._changed.notify_all()
            for _, action in hooks:
                action()

    def on_line(self, text: str, action: Callable[[], None]) -> None:
        with self._changed:
            if any(text in line for lines in self.lines.values() for line in lines):
                action()
                return
            self._hooks.append((text, action))

    def wait_line(self, text: str, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not any(text in line for lines in self.lines.values() for line in lines):
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and not any(
                        t.is_alive() for t in self._readers):
                    return False
                self._changed.wait(min(left, 0.1))
            return True

    def interrupt(self) -> None:
        """Ctrl-C at a terminal: SIGINT to the foreground process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"`sandbox up` still running after {timeout}s: "
                        + "".join(self.lines["err"]))
        for t in self._readers:
            t.join(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return rc, "".join(self.lines["out"]), "".join(self.lines["err"])


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_running(state_root: Path) -> None:
    """The sandbox is all there: its node ready, its devices advertised."""
    status = cli(state_root, "status", "-o", "json")
    assert status.returncode == 0, status.stdout + status.stderr
    [node] = json.loads(status.stdout)["nodes"]
    assert node["ready"], node
    assert node["resources"], node


def assert_down_leaves_nothing(state_root: Path) -> None:
    down = cli(state_root, "down", "--name", NAME)
    assert down.returncode == 0, down.stderr
    assert leftovers(state_root) == []


# -- SIGINT at any moment ----------------------------------------------------------------

DELAYS = [0.0, 0.05, 0.1, 0.2, 0.5, 1.0, 1.5]  # seconds after `up` started
LINES = ["runtime: local", "mounting fake", "starting the reference device plugin",
         "kubelet sees", "is up ("]  # at once when `up` prints this


@pytest.mark.parametrize("moment", [*DELAYS, *LINES],
                         ids=[f"after-{d}s" for d in DELAYS] + [f"at-{m.split()[0]}-line"
                                                                  for m in LINES])
def test_sigint_at_any_moment(state_root: Path, moment: float | str) -> None:
    require_fuse()
    up = RunningUp(state_root)
    if isinstance(moment, str):
        up.on_line(moment, up.interrupt)
    else:
        time.sleep(moment)
        up.interrupt()
    rc, out, err = up.finish()
    if isinstance(moment, float) and python_startup(err):
        # Python's own start-up was interrupted, before sandbox.cli took SIGINT over
        assert leftovers(state_root) == []
        return
    assert "Traceback" not in err, err
    assert "Exception ignored" not in err, err
    assert error_lines(err) == [], err
    if "is up (" in out:
        # printed: the sandbox is up, and a SIGINT after that line leaves it up
        assert rc == 0, err
        assert_running(state_root)
        assert_down_leaves_nothing(state_root)
        return
    assert moment != "is up (", "the `is up` line was printed, so `up` was not interrupted"
    assert rc in (130, -signal.SIGINT), (rc, err)
    assert leftovers(state_root) == [], err


def test_sigint_after_is_up_leaves_it_up(state_root: Path) -> None:
    """The line is on stdout as soon as it is printed (flushed: a script can wait for it),
    and from then on the sandbox is up whatever SIGINT comes."""
    require_fuse()
    up = RunningUp(state_root)
    assert up.wait_line("is up ("), "".join(up.lines["err"])
    up.interrupt()
    up.interrupt()
    rc, out, err = up.finish()
    assert rc == 0, err
    assert "Traceback" not in err, err
    assert_running(state_root)
    assert_down_leaves_nothing(state_root)


def test_up_help_states_the_rule(state_root: Path) -> None:
    help_text = " ".join(cli(state_root, "up", "--help").stdout.split())
    assert "Ctrl-C" in help_text
    assert "exits 130" in help_text
    assert "is coming up" in help_text


# -- down (or a second up) of the same name while up runs ---------------------------------

DOWN_DELAYS = [0.2, 0.5, 0.8, 1.1]
DOWN_LINES = ["runtime: local", "mounting fake", "starting the reference device plugin",
              "kubelet sees"]


@pytest.mark.parametrize("moment", [*DOWN_DELAYS, *DOWN_LINES],
                         ids=[f"after-{d}s" for d in DOWN_DELAYS]
                         + [f"at-{m.split()[0]}-line" for m in DOWN_LINES])
def test_down_during_up(state_root: Path, moment: float | str) -> None:
    require_fuse()
    up = RunningUp(state_root)
    if isinstance(moment, str):
        assert up.wait_line(moment), "".join(up.lines["err"])
    else:
        time.sleep(moment)
    down = cli(state_root, "down", "--name", NAME, timeout=60)
    up_still_running = up.proc.poll() is None
    rc, out, err = up.finish()
    assert "Traceback" not in err + down.stderr, err + down.stderr
    nothing = down.returncode == 0 and "nothing to remove" in down.stderr
    if down.returncode == 0 and not nothing:
        # down may remove it only once `up` is done with it, never under its feet
        assert not up_still_running, (
            f"`down` removed {NAME} while its `up` was still bringing it up; up said: "
            f"{out}{err}")
        assert rc == 0, err
        assert "is up (" in out, err
        assert leftovers(state_root) == []
        return
    if nothing:  # down came before up had recorded anything: it says so and exits 0
        assert f"no sandbox named {NAME!r}" in down.stderr, down.stderr
    else:
        assert down.returncode == 1, down.stderr
        [line] = error_lines(down.stderr)
        assert "is coming up" in line, line
    # down changed nothing: the up it met brings the sandbox up, whole
    assert rc == 0, err
    assert "is up (" in out
    assert_running(state_root)
    assert_down_leaves_nothing(state_root)
