"""The native runtime's ports: never from the kernel's ephemeral range (which outgoing
connections draw from, so a port picked early may be taken when a server binds it),
distinct, and free on every address."""

from __future__ import annotations

import socket
from pathlib import Path

from sandbox.runtimes.native.common import free_ports

NAMES = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kubelet",
         "kubelet-healthz")


def _ephemeral() -> range:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def test_ports_are_distinct_free_and_outside_the_ephemeral_range() -> None:
    for _ in range(50):
        ports = free_ports(NAMES)
        assert list(ports) == list(NAMES)
        assert len(set(ports.values())) == len(NAMES)
        assert not set(ports.values()) & set(_ephemeral())
        held = []
        try:
            for port in ports.values():  # each binds on all addresses, as the kubelet does
                s = socket.socket()
                held.append(s)
                s.bind(("0.0.0.0", port))
        finally:
            for s in held:
                s.close()


def test_a_port_in_use_on_any_address_is_never_chosen() -> None:
    taken = []
    try:
        # take most of the candidates (a listener on 127.0.0.1 blocks 0.0.0.0 too)
        for port in range(max(1024, _ephemeral().start - 8000), _ephemeral().start):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            s.listen()
            taken.append(s)
            if len(taken) >= 7900:
                break
        busy = {s.getsockname()[1] for s in taken}
        for _ in range(20):
            assert not set(free_ports(NAMES).values()) & busy
    finally:
        for s in taken:
            s.close()
