"""``sandbox.prestart``: a program imported ahead of time and run, in the same process,
once its go file appears (how the local runtime starts each node's device plugin beside
the mount server). Real processes; the program is a small package in tmp_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROGRAM = {
    # imported with the package, once, before the go file exists
    "__init__.py": "import os\nopen(os.environ['MARK'], 'w').write(str(os.getpid()))\n",
    "__main__.py": (
        "import json, os, sys\n"
        "def main():\n"
        "    json.dump({'argv': sys.argv[1:], 'pid': os.getpid(), 'name': __name__},\n"
        "              open(os.environ['OUT'], 'w'))\n"
        "    return 5\n"
        "if __name__ == '__main__':\n"
        "    sys.exit(main())\n"
    ),
}


def _start(tmp_path: Path, go: Path, seconds: float) -> tuple[subprocess.Popen[str], Path, Path]:
    pkg = tmp_path / "prog"
    pkg.mkdir(exist_ok=True)
    for name, text in PROGRAM.items():
        (pkg / name).write_text(text)
    mark, out = tmp_path / "imported", tmp_path / "ran.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
           "MARK": str(mark), "OUT": str(out)}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox.prestart", str(go), str(seconds), "prog", "a", "--b"],
        env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip
    return proc, mark, out


def test_imports_at_once_and_runs_the_program_when_the_file_appears(tmp_path: Path) -> None:
    go = tmp_path / "go"
    proc, mark, out = _start(tmp_path, go, 60)
    deadline = time.monotonic() + 30
    while not mark.exists():
        assert time.monotonic() < deadline, "the program was never imported"
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.02)
    time.sleep(0.3)
    assert proc.poll() is None  # held until the go file
    assert not out.exists()
    go.touch()
    assert proc.wait(30) == 5, proc.communicate()[1]  # the program's exit status
    ran = json.loads(out.read_text())
    assert ran == {"argv": ["a", "--b"], "pid": proc.pid, "name": "__main__"}
    assert int(mark.read_text()) == proc.pid
    assert "RuntimeWarning" not in proc.communicate()[1]


def test_without_the_file_it_gives_up_running_nothing(tmp_path: Path) -> None:
    proc, mark, out = _start(tmp_path, tmp_path / "never", 0.3)
    assert proc.wait(30) == 3
    err = proc.communicate()[1]
    assert "did not appear within 0.3 s; not starting prog" in err, err
    assert mark.exists()
    assert not out.exists()


def test_usage_error() -> None:
    done = subprocess.run([sys.executable, "-m", "sandbox.prestart", "go"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("usage: python -m sandbox.prestart GO_FILE SECONDS MODULE")
