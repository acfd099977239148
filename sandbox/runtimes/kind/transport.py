"""How this process reaches a kind node's unix sockets: the fake hardware's control
socket (``sandbox fault``, ``status``) and the kubelet's pod-resources API (``status``).

``host``  the sockets are in the state dir, bind-mounted into the node
          (kind-config/node.yaml): a unix socket works across a bind mount when the Docker
          daemon runs on this machine's kernel.
``exec``  where it does not (Docker Desktop, whose daemon runs in a VM; a remote
          DOCKER_HOST), each connection is relayed through the Kubernetes API: ``python -m
          sandbox.relay PATH`` runs in the node's agent pod (``kubectl exec``'s protocol)
          and its stdin and stdout are joined to a socket this process listens on, in a
          private directory (0700) under /tmp for as long as the command needs it.

``up`` chooses one (``choose``) and records it; ``SANDBOX_TRANSPORT=host|exec`` (or
``--transport`` of ``fault`` and ``status``) overrides the record.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from sandbox.errors import ControlError, SandboxError
from sandbox.runtimes.kind.api import POD_RESOURCES_IN_NODE, STATE_IN_NODE

TRANSPORT_ENV = "SANDBOX_TRANSPORT"
TRANSPORTS = ("host", "exec")
POLL = 0.01  # seconds between looks at either side of a relayed connection
CHUNK = 65536


def forced() -> str | None:
    """``host`` or ``exec`` when SANDBOX_TRANSPORT says so; SandboxError for a value that
    is neither (``auto`` and unset: None)."""
    value = os.environ.get(TRANSPORT_ENV, "").strip()
    if value in ("", "auto"):
        return None
    if value not in TRANSPORTS:
        raise SandboxError(f"{TRANSPORT_ENV}={value!r}: expected auto, host or exec")
    return value


def choose(docker: Any, info: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """The transport a new sandbox records, and why: ``exec`` where the Docker daemon does
    not run on this machine's kernel, else ``host``. ``info``: the daemon's ``docker info``
    if the caller has it already (else asked here)."""
    chosen = forced()
    if chosen is not None:
        return chosen, f"{TRANSPORT_ENV}={chosen}"
    if sys.platform != "linux":
        return "exec", f"Docker runs in a VM on {sys.platform}"
    docker_host = os.environ.get("DOCKER_HOST", "")
    if docker_host and not docker_host.startswith("unix://"):
        return "exec", f"DOCKER_HOST={docker_host} is not a local socket"
    try:
        system = str((docker.info() if info is None else info).get("OperatingSystem", ""))
    except Exception:  # noqa: BLE001 - docker raises many types; up fails elsewhere if so
        system = ""
    if "Docker Desktop" in system:
        return "exec", "Docker Desktop runs its daemon in a VM"
    return "host", "the Docker daemon runs on this machine"


def transport_for(recorded: str | None) -> str:
    """What to use now: SANDBOX_TRANSPORT, else what ``up`` recorded (``host`` for a
    sandbox recorded before there was a choice)."""
    return forced() or recorded or "host"


def in_agent(node_dir: Path, host_path: Path) -> str:
    """The path inside the node's agent pod of ``host_path``, a socket under the node's
    state dir ``node_dir`` (``<state>/nodes/<replica>``)."""
    try:
        rel = host_path.relative_to(node_dir)
    except ValueError:
        raise SandboxError(f"{host_path}: not under the node's state dir {node_dir}") from None
    if rel.parts[:1] == ("pod-resources",):
        return str(Path(POD_RESOURCES_IN_NODE, *rel.parts[1:]))
    return str(Path(STATE_IN_NODE, rel))


@contextlib.contextmanager
def relayed(kubeconfig: Path, namespace: str, selector: str, path: str,
            what: str) -> Iterator[Path]:
    """A local socket path whose every connection is relayed to ``path`` in the running
    pod matched by ``selector``; removed, with every relay, when the block ends."""
    from kubernetes import client, config

    # the typed client here (kubernetes.stream needs it), one of its own: `stream` patches
    # it while it connects
    api = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    try:
        pods = api.list_namespaced_pod(namespace, label_selector=selector).items
    except Exception as exc:  # noqa: BLE001 - the API server is gone or unreachable
        raise ControlError(f"{what}: the cluster's API server does not answer "
                           f"({type(exc).__name__}); is the kind cluster running?") from exc
    running = [p for p in pods if p.status.phase == "Running"]
    if not running:
        raise ControlError(f"{what}: no running pod {selector} in namespace {namespace} "
                           f"to relay through (SANDBOX_TRANSPORT=exec); see `kubectl -n "
                           f"{namespace} get pods`")
    forwarder = _Forwarder(api, namespace, running[0].metadata.name, path)
    with forwarder as local:
        try:
            yield local
        except ControlError as exc:
            if forwarder.errors:
                raise ControlError(f"{exc} (exec transport: {forwarder.errors[-1]})") from exc
            raise


class _Forwarder:
    """Listens on a socket in a private temporary directory; each connection gets its own
    ``python -m sandbox.relay PATH`` in the pod, bytes copied both ways until one side
    ends."""

    def __init__(self, api: Any, namespace: str, pod: str, path: str) -> None:
        self.api, self.namespace, self.pod, self.path = api, namespace, pod, path
        self.errors: list[str] = []
        self._lock = threading.Lock()  # `stream` patches the client while it connects
        self._conns: list[socket.socket] = []
        self._closing = False

    def __enter__(self) -> Path:
        self._dir = Path(tempfile.mkdtemp(prefix="hwsb-relay-", dir="/tmp"))  # mode 0700
        local = self._dir / "sock"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(local))
        os.chmod(local, 0o600)
        self._listener.listen(16)
        threading.Thread(target=self._accept, name="hwsb-relay", daemon=True).start()
        return local

    def __exit__(self, *exc: object) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="hwsb-relay-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        from kubernetes.stream import stream

        try:
            with self._lock:
                ws = stream(self.api.connect_get_namespaced_pod_exec, self.pod,
                            self.namespace, container="agent",
                            command=["python3", "-m", "sandbox.relay", self.path],
                            stdin=True, stdout=True, stderr=True, tty=False,
                            _preload_content=False, binary=True)
        except Exception as exc:  # noqa: BLE001 - websocket and API errors of many types
            self.errors.append(f"exec in pod {self.namespace}/{self.pod}: {exc}")
            conn.close()
            return
        try:
            self._pump(conn, ws)
        except OSError:
            pass  # the local side went away: nothing to copy to
        finally:
            with contextlib.suppress(Exception):
                ws.close()
            conn.close()
            with contextlib.suppress(ValueError):
                self._conns.remove(conn)

    def _pump(self, conn: socket.socket, ws: Any) -> None:
        local_open = True
        while ws.is_open():
            ws.update(timeout=POLL)
            if ws.peek_stdout():
                conn.sendall(ws.read_stdout())
            if ws.peek_stderr():
                self.errors.append(ws.read_stderr().decode(errors="replace").strip())
            if local_open and select.select([conn], [], [], 0)[0]:
                data = conn.recv(CHUNK)
                if data:
                    ws.write_stdin(data)
                else:  # the client has sent all it will: tell the relay, if it can hear it
                    local_open = False
                    if getattr(ws, "subprotocol", "") == "v5.channel.k8s.io":
                        ws.close_channel(0)
                    else:
                        return
        while ws.peek_stdout():
            conn.sendall(ws.read_stdout())
