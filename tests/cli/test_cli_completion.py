"""Issue 26: `sandbox completion bash|zsh|fish`, loaded into the real shells and asked
what completes a line (bash and zsh call the completion function as bash's
programmable completion would; fish answers `complete -C`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import REPO, sandbox

pytestmark = [pytest.mark.root]

PROFILES = sorted(p.stem for p in (REPO / "profiles").glob("*.yaml"))
FAULT_VERBS = ["health", "unplug", "plug", "set-vfs", "list", "watch", "run", "reset",
               "restart-kubelet"]
# line -> what must be offered (the first word of each line is `sandbox`)
CASES = [
    ("sandbox fa", ["fault"]),
    ("sandbox fault ", FAULT_VERBS),
    ("sandbox fault health --reason a", ["aer-fatal"]),
    ("sandbox up --runtime ", ["auto", "kind", "local", "native"]),
    ("sandbox -v fault health n d --re", ["--reason"]),
    ("sandbox dra slices -o ", ["json", "yaml"]),
    ("sandbox up 8gpu", ["8gpu-2numa"]),
    ("sandbox validate ", PROFILES),
]


def _shell(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is needed for this test: apt-get install {name} "
                    "(scripts/test installs it)", pytrace=False)
    return path


def _script(shell: str, tmp_path: Path) -> Path:
    out = sandbox("completion", shell)
    assert out.returncode == 0, out.stderr
    path = tmp_path / f"sandbox.{shell}"
    path.write_text(out.stdout)
    return path


ASK = """
ask() {
    COMP_WORDS=(SPLIT)
    case "$1" in *" ") COMP_WORDS+=("") ;; esac
    COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
    COMPREPLY=()
    _sandbox
    echo "${COMPREPLY[*]}"
}
"""


def _offered_bash_like(shell: str, script: Path, line: str) -> set[str]:
    setup = ("autoload -U compinit; compinit -u; setopt ksh_arrays; "
             if shell == "zsh" else "")
    argv = [_shell(shell), "-f"] if shell == "zsh" else [_shell(shell), "--norc"]
    ask = ASK.replace("SPLIT", "${=1}" if shell == "zsh" else "$1")  # zsh splits on demand
    result = subprocess.run([*argv, "-c", f'{setup}source {script}\n{ask}\nask "$1"', "x",
                             line], capture_output=True, text=True, check=False, timeout=30,
                            cwd=REPO)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "not found" not in result.stderr, result.stderr
    return set(result.stdout.split())


@pytest.mark.parametrize("shell", ["bash", "zsh"])
@pytest.mark.parametrize(("line", "offered"), CASES)
def test_bash_and_zsh(shell: str, line: str, offered: list[str], tmp_path: Path) -> None:
    got = _offered_bash_like(shell, _script(shell, tmp_path), line)
    assert set(offered) <= got, (line, sorted(got))
    # bash filters by the word typed; zsh's compgen leaves that to its own compadd. Only
    # profile positions list files as well.
    if shell == "bash" and not line.endswith(("8gpu", "validate ")):
        assert got == set(offered), (line, sorted(got))


@pytest.mark.parametrize(("line", "offered"), CASES)
def test_fish(line: str, offered: list[str], tmp_path: Path) -> None:
    script = _script("fish", tmp_path)
    result = subprocess.run([_shell("fish"), "--no-config", "-c",
                             f"source {script}; complete -C $argv[1]", line],
                            capture_output=True, text=True, check=False, timeout=30, cwd=REPO)
    assert result.returncode == 0, result.stderr
    got = {row.split("\t")[0] for row in result.stdout.splitlines()}
    assert set(offered) <= got, (line, sorted(got))


def test_every_verb_is_completed(tmp_path: Path) -> None:
    """The script is made from the parser: every verb of `sandbox --help` is in it."""
    from sandbox.cli import VERBS

    help_text = sandbox("--help").stdout
    verbs = [v for v in VERBS if f"\n    {v} " in help_text]
    assert len(verbs) == len(VERBS), help_text
    got = _offered_bash_like("bash", _script("bash", tmp_path), "sandbox ")
    assert set(verbs) == got, sorted(got)
