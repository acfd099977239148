"""sandbox.commands.run: a failed command's error says why in a few lines, real commands."""

from __future__ import annotations

import pytest

from sandbox.commands import run
from sandbox.errors import CommandError


def _failure(script: str) -> str:
    with pytest.raises(CommandError) as caught:
        run(["sh", "-c", script], step="cluster")
    return str(caught.value)


def test_a_go_programs_error_lines_not_its_stack_trace() -> None:
    # what `kind create cluster` prints when kubeadm init fails: kind's ERROR line, then
    # kubeadm's output ending in its error and a stack trace
    said = _failure(
        'echo "Creating cluster ..."; '
        'echo "ERROR: failed to create cluster: failed to init node with kubeadm: exit status 1"; '
        'echo "Command Output: [init] Using Kubernetes version: v1.37.2"; '
        'echo "error execution phase wait-control-plane: could not initialize a cluster"; '
        'for f in workflow.go:260 kubeadm.go:25 proc.go:290 asm_amd64.s:1771; do '
        'printf "\\truntime.frame\\n\\t%s\\n" "$f"; done; exit 1')
    lines = said.splitlines()
    assert lines[0].startswith("cluster: command 'sh -c "), said
    assert lines[0].endswith("exited 1"), said
    assert lines[1:] == [
        "  ERROR: failed to create cluster: failed to init node with kubeadm: exit status 1",
        "  error execution phase wait-control-plane: could not initialize a cluster"], said


def test_without_error_lines_the_last_five() -> None:
    said = _failure("for i in 1 2 3 4 5 6 7; do echo line$i; done; exit 3")
    assert said.endswith("exited 3\n  line3\n  line4\n  line5\n  line6\n  line7"), said


def test_long_lines_are_cut() -> None:
    said = _failure("printf 'error: %0400d\\n' 0; exit 2")
    assert said.splitlines()[1] == "  error: " + "0" * 293, said
