"""``python -m sandbox.relay SOCKET``: one connection to the unix socket SOCKET, copied
to and from this process's standard input and output until both sides have ended.

It is how the CLI reaches a node's sockets where the host cannot connect to them itself
(Docker Desktop, a remote Docker host): ``runtimes.kind.transport`` runs it in the node's
agent pod through the Kubernetes API and joins its stdin and stdout to a local socket.
Standard library only, so that it starts fast; bytes are copied as they are.
"""

from __future__ import annotations

import os
import selectors
import socket
import sys

CHUNK = 65536


def relay(path: str, stdin: int = 0, stdout: int = 1) -> int:
    """Copy until the socket's peer has closed and stdin has ended (or the socket's peer
    closed first: then there is no one left to write to). Returns the exit code."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        print(f"relay: cannot connect to {path}: {exc.strerror}", file=sys.stderr)
        return 1
    sel = selectors.DefaultSelector()
    sel.register(stdin, selectors.EVENT_READ, "in")
    sel.register(sock, selectors.EVENT_READ, "sock")
    with sock:
        while True:
            for key, _ in sel.select():
                if key.data == "in":
                    data = os.read(stdin, CHUNK)
                    if not data:  # no more requests: the peer still answers what it has
                        sel.unregister(stdin)
                        sock.shutdown(socket.SHUT_WR)
                        continue
                    sock.sendall(data)
                else:
                    data = sock.recv(CHUNK)
                    if not data:
                        return 0
                    view = memoryview(data)
                    while view:
                        view = view[os.write(stdout, view):]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m sandbox.relay SOCKET", file=sys.stderr)
        return 2
    try:
        return relay(args[0])
    except (BrokenPipeError, ConnectionResetError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
