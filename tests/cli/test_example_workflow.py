"""The example CI workflow users copy (.github/workflows/sandbox-example.yml) stays correct.

Every `sandbox ...` command in its `run:` steps is parsed by the CLI's own argparse parser
(built as `sandbox.cli.main` builds it; parsing only, nothing is run), so a renamed verb,
dropped flag or missing positional breaks this test rather than the users' CI. It must
also install the way the README does (`scripts/install` from a checkout, as root) and
never `pip install` into the runner's system python, which ubuntu-24.04 refuses (PEP 668).
"""

from __future__ import annotations

import contextlib
import io
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sandbox.cli import build_parser
from tests.support.paths import REPO as ROOT

pytestmark = [pytest.mark.root]

WORKFLOW = ROOT / ".github" / "workflows" / "sandbox-example.yml"
CLONE = "/tmp/hw-sandbox"  # where the workflow clones hw-sandbox

CONTROL = {"&&", "||", ";", "|", "&", "(", ")"}
# sudo options taking a value (`sudo -u USER cmd`); every other option is a bare flag.
SUDO_VALUE_OPTIONS = {"-u", "-g", "-C", "-D", "-h", "-p", "-r", "-t", "-U", "-T"}
PYTHONS = {"python", "python3"} | {f"python3.{minor}" for minor in range(8, 20)}


def run_blocks(workflow: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(step label, run text) of every `run:` step of every job."""
    for job_id, job in workflow["jobs"].items():
        for i, step in enumerate(job.get("steps", [])):
            if "run" in step:
                yield f"{job_id}: {step.get('name', f'step {i}')}", step["run"]


def logical_lines(script: str) -> Iterator[str]:
    """The shell lines of a run block: continuations joined, comments and blanks dropped."""
    pending = ""
    for raw in script.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.strip()[:-1].strip() + " "
            continue
        line = (pending + raw.strip()).strip()
        pending = ""
        if line and not line.startswith("#"):
            yield line
    if pending.strip():
        yield pending.strip()


def simple_commands(line: str) -> Iterator[list[str]]:
    """The words of each simple command on a shell line (split at &&, ||, ;, |, &)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words: list[str] = []
    for token in lexer:
        if token in CONTROL:
            if words:
                yield words
            words = []
        else:
            words.append(token)
    if words:
        yield words


def unwrap(words: list[str]) -> tuple[bool, list[str]]:
    """(run as root?, the command) with `sudo [options]` and VAR=value prefixes removed."""
    root = False
    i = 0
    while i < len(words):
        word = words[i]
        if word == "sudo":
            root = True
            i += 1
            while i < len(words) and words[i].startswith("-"):
                option = words[i]
                i += 2 if option in SUDO_VALUE_OPTIONS else 1
                if option == "--":
                    break
        elif "=" in word and word.split("=", 1)[0].isidentifier():
            i += 1
        else:
            break
    return root, words[i:]


def commands(script: str) -> Iterator[tuple[str, bool, list[str]]]:
    """(line, as root?, argv) of every command a run block runs."""
    for line in logical_lines(script):
        for words in simple_commands(line):
            root, argv = unwrap(words)
            if argv:
                yield line, root, argv


def sandbox_commands(script: str) -> Iterator[tuple[str, list[str]]]:
    """(line, argv after `sandbox`) of every `sandbox ...` command in a run block."""
    for line, _root, argv in commands(script):
        if Path(argv[0]).name == "sandbox":
            yield line, argv[1:]


def cli_error(argv: list[str]) -> str | None:
    """Why the sandbox CLI would reject `sandbox ARGV` (None if it parses to a command).

    Only parses: the parser is built exactly as `sandbox.cli.main` does (which imports and
    registers the chosen verb's module) and `parse_args` never calls the verb's `run`.
    """
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            args = build_parser(argv).parse_args(argv)
        except SystemExit as exc:  # argparse: --help/--version exit 0, errors exit 2
            if exc.code in (0, None):
                return None
            lines = err.getvalue().strip().splitlines()
            return lines[-1] if lines else f"argparse exited {exc.code}"
    if getattr(args, "func", None) is None:
        return "no command: `sandbox` alone prints its help and exits 2"
    return None


def is_system_pip_install(argv: list[str]) -> bool:
    """`pip install` (or `python3 -m pip install`) with a system interpreter: PEP 668."""
    program = argv[0]
    if Path(program).name in PYTHONS and argv[1:3] == ["-m", "pip"]:
        args = argv[3:]
    elif Path(program).name in {"pip", "pip3"}:
        args = argv[1:]
    else:
        return False
    if "/" in program and not program.startswith(("/usr/", "/bin/")):
        return False  # a virtualenv's, e.g. "$venv/bin/pip"
    return "install" in args


@pytest.fixture(scope="module")
def workflow() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(WORKFLOW.read_text())
    return data


def test_every_sandbox_command_parses(workflow: dict[str, Any]) -> None:
    seen: list[str] = []
    problems = []
    for step, script in run_blocks(workflow):
        for line, argv in sandbox_commands(script):
            seen.append(argv[0] if argv else "")
            error = cli_error(argv)
            if error is not None:
                problems.append(f"{step}: `{line}`\n    {error}")
    assert not problems, "sandbox commands the CLI rejects:\n" + "\n".join(problems)
    # The extractor found the commands (it would "pass" on a workflow it cannot read).
    assert {"up", "status", "fault", "kubelet", "down"} <= set(seen), seen


def test_installs_with_scripts_install_not_system_pip(workflow: dict[str, Any]) -> None:
    order: list[str] = []
    for step, script in run_blocks(workflow):
        for line, root, argv in commands(script):
            assert not is_system_pip_install(argv), (
                f"{step}: `{line}`: pip into the system python; ubuntu-24.04 refuses it "
                "(PEP 668). Use scripts/install, as the README does."
            )
            if argv[0].endswith("/scripts/install"):
                # As root: then the virtualenv's `sandbox` is linked into /usr/local/bin,
                # which is on sudo's secure_path (~/.local/bin is not).
                assert root, f"{step}: `{line}`: run scripts/install with sudo"
                order.append("install")
            elif Path(argv[0]).name == "sandbox":
                order.append("sandbox")
    assert "install" in order, "the workflow must install hw-sandbox with scripts/install"
    assert order.index("install") < order.index("sandbox"), "install before using sandbox"


def test_paths_into_the_clone_exist(workflow: dict[str, Any]) -> None:
    """Files the workflow uses from its hw-sandbox clone exist in this checkout."""
    scripts = [script for _step, script in run_blocks(workflow)]
    assert any(argv[:2] == ["git", "clone"] and argv[-1] == CLONE
               for script in scripts for _line, _root, argv in commands(script))
    used = {word for script in scripts for _line, _root, argv in commands(script)
            for word in argv if word.startswith(CLONE + "/")}
    assert used, f"no path under {CLONE} found"
    missing = sorted(w for w in used if not (ROOT / w.removeprefix(CLONE + "/")).exists())
    assert not missing, f"not in the repository: {missing}"


# The checker has teeth -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("sandbox status --colour", "unrecognized arguments: --colour"),
        ("sandbox teleport", "invalid choice: 'teleport'"),
        ("sandbox fault health gpu-worker gpu1", "the following arguments are required"),
        ("sandbox fault health gpu-worker gpu1 sick", "invalid choice: 'sick'"),
        ("sandbox up p.yaml --runtime docker", "invalid choice: 'docker'"),
        ("sandbox fault", "the following arguments are required: ACTION"),
        ("sandbox", "no command"),
    ],
)
def test_checker_rejects_bad_commands(line: str, expected: str) -> None:
    [(_line, argv)] = sandbox_commands(line)
    error = cli_error(argv)
    assert error is not None
    assert expected in error


def test_extractor_reads_shell_forms() -> None:
    script = """\
# a comment: sandbox nothing
sudo sandbox status
sudo -E sandbox up /tmp/p.yaml --runtime kind
sleep 5 && sudo sandbox status --output json
sudo -u root FOO=1 sandbox fault list || true; sandbox down --name \\
    demo
/usr/local/bin/sandbox kubelet check -- ./bin/plugin --flag
"""
    assert list(sandbox_commands(script)) == [
        ("sudo sandbox status", ["status"]),
        ("sudo -E sandbox up /tmp/p.yaml --runtime kind",
         ["up", "/tmp/p.yaml", "--runtime", "kind"]),
        ("sleep 5 && sudo sandbox status --output json", ["status", "--output", "json"]),
        ("sudo -u root FOO=1 sandbox fault list || true; sandbox down --name demo",
         ["fault", "list"]),
        ("sudo -u root FOO=1 sandbox fault list || true; sandbox down --name demo",
         ["down", "--name", "demo"]),
        ("/usr/local/bin/sandbox kubelet check -- ./bin/plugin --flag",
         ["kubelet", "check", "--", "./bin/plugin", "--flag"]),
    ]
    assert all(cli_error(argv) is None for _line, argv in sandbox_commands(script))


def test_system_pip_is_flagged() -> None:
    def flagged(line: str) -> bool:
        return any(is_system_pip_install(argv) for _l, _r, argv in commands(line))

    assert flagged("sudo python3 -m pip install /tmp/hw-sandbox")
    assert flagged("pip install --user .")
    assert flagged("sudo -E /usr/bin/python3 -m pip install .")
    assert not flagged('"$venv/bin/pip" install .')
    assert not flagged("/tmp/venv/bin/python3 -m pip install .")
    assert not flagged("python3 -m pip --version")
