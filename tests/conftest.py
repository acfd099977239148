"""What every test shares: the marker policy and the toy control server.

Markers (registered in pyproject.toml): ``root`` needs root (FUSE mounts served as root,
mknod, mount namespaces, root-only sockets, Docker, a real Kubernetes); ``fuse`` needs
/dev/fuse and fusermount3; ``network`` needs the Go module proxy or a Debian mirror the
first time. A ``root`` test run by another user FAILS with a hint (it never skips), so
``pytest -m "not root"`` is how an unprivileged user runs the rest. Everything under
tests/e2e and tests/kind_e2e is ``root`` and ``network``.

``alone`` marks a test that compares host-wide state (the mount table, /dev, /run, the
kubelet's directories) before and after itself: under pytest-xdist (``pytest -n 4``) it
waits until no other test is running, and no other test starts until it
is done. The turns are ``flock``s on two directories of the checkout, so they hold across
the workers' processes and leave nothing behind. A ``cpu_bound`` test (pure CPU work inside
its temp dir: scripts/test runs those in a pytest of their own beside the others) takes no
turn: an ``alone`` test has nothing of it to wait for.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.support import steps
from tests.support.fakehw_toy import Server, serving
from tests.support.paths import REPO

_CLUSTER_DIRS = (REPO / "tests" / "e2e", REPO / "tests" / "kind_e2e")
# flock'ed directories: the host (shared by every test, exclusive for an ``alone`` one)
# and a turnstile in front of it, so that a waiting ``alone`` test is not starved by the
# other worker's next tests
_HOST_LOCK = REPO / "tests" / "support"
_TURNSTILE = REPO / "tests"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path))
        if any(path.is_relative_to(d) for d in _CLUSTER_DIRS):
            item.add_marker(pytest.mark.root)
            item.add_marker(pytest.mark.network)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    steps.LOG.report(terminalreporter)  # the e2e envs' slowest steps (tests/support/steps.py)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") is not None and os.geteuid() != 0:
        pytest.fail(
            "needs root (FUSE served as root, mknod, mount namespaces, root-only sockets, "
            "Docker or a real Kubernetes); run as root, or only the tests that do not: "
            "pytest -m 'not root'",
            pytrace=False,
        )


@contextlib.contextmanager
def _host_turn(alone: bool) -> Iterator[None]:
    turnstile = os.open(_TURNSTILE, os.O_RDONLY | os.O_DIRECTORY)
    host = os.open(_HOST_LOCK, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if alone:  # holding the turnstile: no new test starts while the running ones end
            fcntl.flock(host, fcntl.LOCK_EX)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(host, fcntl.LOCK_SH)
        yield
    finally:  # closing drops the locks
        os.close(host)
        os.close(turnstile)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item,
                            nextitem: pytest.Item | None) -> Generator[None, object, object]:
    # the whole protocol: setup (module and session fixtures included), call, teardown
    if item.get_closest_marker("cpu_bound") is not None:
        return (yield)
    with _host_turn(item.get_closest_marker("alone") is not None):
        return (yield)


@pytest.fixture
def toy_server(tmp_path: Path) -> Iterator[Server]:
    """A toy tree served over FUSE with its control socket, for one test."""
    with serving(tmp_path / "root") as srv:
        yield srv


@pytest.fixture(scope="module")
def shared_toy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One toy server for a module's tests, which must leave it as they found it."""
    with serving(tmp_path_factory.mktemp("toy") / "root") as srv:
        yield srv
