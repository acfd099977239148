"""`sandbox kubelet check --profile`: a stock plugin graded on a profile's node served live
over FUSE, run unmodified in a private mount namespace where the tree is /sys, /dev and
/proc/driver and the harness is /var/lib/kubelet/device-plugins; and `--junit` in both
modes. Real processes (the console script's module, our plugin, a small Python plugin),
real FUSE, real gRPC; the host's mounts, /sys and /var/lib/kubelet are compared before
and after."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakehw_toy import require_fuse

# `alone`: the host fixture compares the host's mounts, /dev and kubelet dirs before and after
pytestmark = [pytest.mark.root, pytest.mark.fuse, pytest.mark.alone]

CHECK = [sys.executable, "-m", "sandbox", "kubelet", "check"]
PLUGIN = [sys.executable, "-m", "hwplugins.deviceplugin"]  # stock defaults: no flags
CHECKS = ("registers", "serves-before-register", "registration-accepted", "options",
          "list-and-watch", "allocate", "health-update", "restart", "still-running")
STOCK = Path("/var/lib/kubelet/device-plugins")

# Serves, registers once through $KUBELET_DEVICE_PLUGIN_DIR, advertises Dev-1 and Dev-2
# (names no profile device has), and never registers again after a kubelet restart.
ONCE_PLUGIN = textwrap.dedent(
    '''
    import os, sys, time
    from concurrent.futures import ThreadPoolExecutor
    import grpc
    from hwplugins.api import deviceplugin_v1beta1_pb2 as pb
    from hwplugins.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc

    d = os.environ["KUBELET_DEVICE_PLUGIN_DIR"]

    class Plugin(pb_grpc.DevicePluginServicer):
        def GetDevicePluginOptions(self, request, context):
            return pb.DevicePluginOptions()
        def ListAndWatch(self, request, context):
            yield pb.ListAndWatchResponse(devices=[
                pb.Device(ID=f"Dev-{i}", health="Healthy") for i in (1, 2)])
            while context.is_active():
                time.sleep(0.1)
        def Allocate(self, request, context):
            return pb.AllocateResponse(container_responses=[
                pb.ContainerAllocateResponse() for _ in request.container_requests])

    server = grpc.server(ThreadPoolExecutor(4))
    pb_grpc.add_DevicePluginServicer_to_server(Plugin(), server)
    server.add_insecure_port(f"unix://{d}/once.sock")
    server.start()
    with grpc.insecure_channel(f"unix://{d}/kubelet.sock") as ch:
        pb_grpc.RegistrationStub(ch).Register(pb.RegisterRequest(
            version="v1beta1", endpoint="once.sock", resource_name="example.com/once"),
            timeout=30)
    pci = "/sys/bus/pci/devices"
    nvidia = sum(open(f"{pci}/{f}/vendor").read().strip() == "0x10de" for f in os.listdir(pci))
    print(f"registered in {d}; {nvidia} NVIDIA functions; \\x1b[31mcolour\\x1b[0m",
          flush=True)
    time.sleep(3600)
    '''
)


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CHECK, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def _junit(path: Path) -> tuple[ET.Element, dict[str, ET.Element]]:
    """The one testsuite of a JUnit file and its testcases by name."""
    top = ET.parse(path).getroot()
    assert top.tag == "testsuites"
    (suite,) = top.findall("testsuite")
    assert suite.get("name") == "sandbox-kubelet-check"
    cases = {c.get("name", ""): c for c in suite.findall("testcase")}
    assert all(c.get("classname") == "sandbox-kubelet-check" for c in cases.values())
    return suite, cases


# Where the check mounts (in the plugin's namespace) or could leave a mount by mistake;
# elsewhere (another test's sandbox under /tmp, on a busy machine) is not its doing.
REACH = ("/sys", "/dev", "/proc", "/var", "/run", "/tmp/kc-")


def _mountinfo() -> list[str]:
    """The host's mount table where the check reaches, mount ids and all."""
    def ours(line: str) -> bool:
        point = line.split()[4]
        return point == "/" or any(point == r or point.startswith(r if r.endswith("-")
                                                                 else r + "/") for r in REACH)
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if ours(line)]


def _listing(path: Path) -> list[str] | None:
    return sorted(os.listdir(path)) if path.is_dir() else None


def _host() -> dict[str, Any]:
    """What the check must leave as it found it on the host."""
    return {
        "mounts": _mountinfo(),
        "sys": [_listing(Path(p)) for p in ("/sys", "/sys/bus/pci/devices", "/sys/class")],
        "dev": _listing(Path("/dev")),
        "kubelet": [_listing(Path(p)) for p in ("/var/lib/kubelet", STOCK)],  # None: none
    }


def _processes_naming(text: str) -> list[str]:
    """Processes with ``text`` in their command line, or in their mount table: a plugin
    left running would keep its namespace, whose binds name the work dir."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            mounts = (proc / "mountinfo").read_text(errors="replace")
        except OSError:
            continue
        if text in args or text in mounts:
            found.append(f"{proc.name}: {args}")
    return found


@pytest.fixture
def host() -> Iterator[dict[str, Any]]:
    """The host as it was before the test; asserted unchanged after it."""
    require_fuse()
    before = _host()
    yield before
    after = _host()
    mounts = ([f"- {m}" for m in before["mounts"] if m not in after["mounts"]]
              + [f"+ {m}" for m in after["mounts"] if m not in before["mounts"]])
    assert mounts == []
    assert after == before


def _workdir(log: str) -> Path:
    """The check's work dir, from its protocol log (WORKDIR/device-plugins/kubelet.sock)."""
    found = re.search(r"kubelet-start +(/tmp/kc-[^/\s]+)/device-plugins/kubelet.sock", log)
    assert found is not None, log
    return Path(found.group(1))


def _left(workdir: Path) -> list[str]:
    """What is left of a check with this work dir: the dir, a mount in it, a process
    naming it (a server) or with it in its mount table (a plugin's namespace)."""
    return ([str(workdir)] if workdir.exists() else []) + \
        [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
         if str(workdir) in line] + _processes_naming(str(workdir))


def test_our_plugin_with_stock_defaults_passes_every_check(host: dict[str, Any],
                                                           tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    out = _run("--profile", "8gpu-2numa", "--timeout", "30", "--restart-within", "15",
               "-o", "json", "--junit", str(report), "--", *PLUGIN)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert {c["name"]: c["status"] for c in data["checks"]} == dict.fromkeys(CHECKS, "pass")
    messages = {c["name"]: c["message"] for c in data["checks"]}
    assert messages["list-and-watch"] == "8 devices, 8 healthy"
    health = messages["health-update"]
    assert "made unhealthy (aer-fatal): new device list" in health, health
    assert health.startswith("gpu"), health
    assert "(advertised as GPU-" in health, health
    assert health.endswith("now 7 healthy"), health
    # the plugin used the stock paths: the kubelet's directory, the node's 8 GPUs in /sys
    assert f"registered with {STOCK}/kubelet.sock" in data["plugin_output"]
    suite, cases = _junit(report)
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("9", "0", "0")
    assert list(cases) == list(CHECKS)
    assert all(len(c) == 0 for c in cases.values())  # no <failure>, no <skipped>
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props == {"plugin": " ".join(PLUGIN), "profile": "8gpu-2numa", "node": "gpu-worker"}
    system_out = suite.findtext("system-out") or ""
    assert "--- protocol log ---" in system_out
    assert "--- plugin output ---" in system_out
    assert f"registered with {STOCK}/kubelet.sock" in system_out
    # nothing left: the work dir, its FUSE mount, the server, the plugin (and `host`)
    assert _left(_workdir(system_out)) == []


def test_fault_overrides_the_checks_own_and_is_told_the_node(host: dict[str, Any]) -> None:
    fault = (f"{sys.executable} -m sandbox fault --socket \"$HWSANDBOX_CONTROL_SOCKET\" "
             "health \"$HWSANDBOX_NODE\" gpu3 unhealthy --reason link-down")
    out = _run("--profile", "8gpu-2numa", "--timeout", "30", "--restart-within", "15",
               "-o", "json", "--fault", fault, "--", *PLUGIN)
    assert out.returncode == 0, out.stdout + out.stderr
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    health = checks["health-update"]
    assert health["status"] == "pass", health
    assert health["message"].startswith("new device list"), health  # not the check's own
    assert health["message"].endswith("now 7 healthy"), health
    events = json.loads(out.stdout)["events"]
    assert _left(_workdir("\n".join(f"{e['kind']} {e['detail']}" for e in events))) == []


@pytest.mark.parametrize("has", ["/var/lib/kubelet", str(STOCK)])
def test_a_host_that_has_the_kubelets_directories(host: dict[str, Any], has: str) -> None:
    """As on a real node: the check runs in a mount namespace (of the test's) where the
    host has /var/lib/kubelet (or its device-plugins too, with a real kubelet's socket
    in it); the plugin still meets the harness only, and the directory keeps its files."""
    script = f"""set -e
    mount -t tmpfs hwsb-test /var/lib
    mkdir -p {has}
    echo real > {has}/kubelet.sock
    {shlex.join(CHECK)} --profile 8gpu-2numa --timeout 30 --restart-within 15 --log -- \\
        {shlex.join(PLUGIN)}
    ls -A {has}
    cat {has}/kubelet.sock
    """
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh",
                          "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "result: PASSED (0 of 9 checks failed)" in out.stdout, out.stdout
    assert out.stdout.splitlines()[-2:] == ["kubelet.sock", "real"]
    assert _left(_workdir(out.stdout)) == []


def test_a_failing_plugin_is_rc_1_with_a_failure_in_junit(host: dict[str, Any],
                                                          tmp_path: Path) -> None:
    script = tmp_path / "once_plugin.py"
    script.write_text(ONCE_PLUGIN)
    report = tmp_path / "report.xml"
    out = _run("--profile", "8gpu-2numa", "--timeout", "30", "--restart-within", "2",
               "--junit", str(report), "--", sys.executable, str(script))
    assert out.returncode == 1, out.stdout + out.stderr
    # It ran where a stock plugin runs, and saw the profile's machine (8 H100s).
    assert f"registered in {STOCK}; 8 NVIDIA functions; " in out.stdout, out.stdout
    lines = {line.split()[1]: line for line in out.stdout.splitlines()
             if line[:4] in ("PASS", "FAIL", "NOT-")}
    assert lines["restart"].startswith("FAIL")
    assert lines["allocate"].startswith("PASS")
    # the check's own fault says why it could not pick a device, rather than skipping mutely
    assert lines["health-update"].startswith("NOT-RUN"), lines["health-update"]
    assert "none of the advertised ids (Dev-1, Dev-2) names a healthy device of node " \
        "gpu-worker" in lines["health-update"]
    suite, cases = _junit(report)
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("9", "1", "1")
    failure = cases["restart"].find("failure")
    assert failure is not None
    assert "not re-registered within 2.0s" in failure.get("message", "")
    skipped = cases["health-update"].find("skipped")
    assert skipped is not None
    assert "Dev-1, Dev-2" in skipped.get("message", "")
    assert len(cases["registers"]) == 0
    # a plugin's colour escapes are not XML 1.0: written out as \x1b
    system_out = suite.findtext("system-out") or ""
    assert "\\x1b[31mcolour\\x1b[0m" in system_out
    assert _left(_workdir(system_out)) == []


def test_junit_from_the_temp_dir_mode(tmp_path: Path) -> None:
    script = tmp_path / "once_plugin.py"
    script.write_text(ONCE_PLUGIN)
    report = tmp_path / "report.xml"
    report.write_text("an old report: replaced\n")
    out = _run("--timeout", "30", "--restart-within", "2", "-o", "yaml", "--junit",
               str(report), "--", sys.executable, str(script))
    assert out.returncode == 1, out.stdout + out.stderr
    suite, cases = _junit(report)
    assert list(cases) == list(CHECKS)
    assert (suite.get("failures"), suite.get("skipped")) == ("1", "1")
    assert cases["restart"].find("failure") is not None
    skipped = cases["health-update"].find("skipped")
    assert skipped is not None
    assert skipped.get("message") == "no fault injector given (--fault, or --profile)"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert set(props) == {"plugin"}
    assert "registered in /tmp/kc-" in (suite.findtext("system-out") or "")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_check_leaves_nothing(host: dict[str, Any], sig: int) -> None:
    known = set(Path("/tmp").glob("kc-*"))
    proc = subprocess.Popen([*CHECK, "--profile", "8gpu-2numa", "--timeout", "60", "--",
                             *PLUGIN], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        # until the plugin has registered: its socket is in the harness's directory
        deadline = time.monotonic() + 120
        while not (sockets := [s for s in Path("/tmp").glob("kc-*/device-plugins/hwplugins-*")
                               if s.parents[1] not in known]):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the plugin never registered"
            time.sleep(0.05)
        workdir = sockets[0].parents[1]
        assert _processes_naming(str(workdir))  # the server and the plugin's namespace
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert err.strip() == "interrupted"
    assert _left(workdir) == []


def test_not_root_is_one_line() -> None:
    """In a user namespace of its own (no uid mapped) the check runs as an unprivileged
    user would: it says so before mounting anything."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare not found: apt-get install util-linux", pytrace=False)
    out = subprocess.run(["unshare", "--user", *CHECK, "--profile", "8gpu-2numa", "--",
                          *PLUGIN], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        "error: kubelet check --profile needs root (CAP_SYS_ADMIN: it mounts the node's tree "
        "over FUSE and gives the plugin a mount namespace): run it with sudo -E"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--profile", "8gpu-2numa", "--", "no-such-plugin", "-v"],
         "error: kubelet check: no-such-plugin: command not found"),
        (["--profile", "8gpu-2numa", "--", "/nonexistent/plugin"],
         "error: kubelet check: /nonexistent/plugin: no such file"),
        (["--profile", "8gpu-2nuna", "--", "true"],
         "error: 8gpu-2nuna:1:1: no such file (did you mean '8gpu-2numa'? `sandbox profiles` "
         "lists the bundled ones)"),
        (["--profile", "workshop-mixed", "--", "true"],
         "error: workshop-mixed has several nodes; pick one with --node (control-plane, "
         "gpu-worker-0, gpu-worker-1, net-worker)"),
        (["--node", "gpu-worker", "--", "true"], "error: --node and --index go with --profile"),
        (["--junit", "/tmp", "--", "true"], "error: /tmp: is a directory"),
    ],
)
def test_bad_input_is_one_line(args: list[str], message: str) -> None:
    out = _run(*args, timeout=120)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [message]
