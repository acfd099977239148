"""Real network links for a served tree's netdevs, in a network namespace of the node's.

The tree's ``sys/class/net`` is only files: a reader that asks the kernel (netlink, as the
SR-IOV network device plugin does; ``ip link``) finds no such interface. This module makes
one real link per netdev the tree shows, in the network namespace where the node's plugins
run (a kind node's own; the native runtime's ``state_dir/plugins-netns``; never the
host's), and keeps them as the tree says:

- a TAP device (``/dev/net/tun``: the one link type every kernel we met has; ``dummy`` is
  often a missing module) with the netdev's name, hardware address, MTU and, where the
  namespace has it free, its ``ifindex``; admin up;
- carrier from the tree's ``carrier`` file (``TUNSETCARRIER``), so ``operstate`` is
  ``up`` or ``down`` (no carrier) as a real NIC's after a link-down fault;
- created and removed as the tree's netdevs come and go (hot-plug, ``set-vfs``).

This process holds each TAP's descriptor and sets none persistent: when it exits, for any
reason, its links are gone with it. It re-reads the tree after every change the control
socket reports (``watch``), so ``ip link`` and ``/sys/class/net`` agree. An IPoIB netdev
(ARPHRD_INFINIBAND, a 20-byte address) is made an Ethernet TAP with its name, MTU and
carrier: netlink shows it with link type ``ether``.

    python -m sandbox.fakehw.netlinks --root ROOT --netns PATH [--control SOCKET]
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import logging
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from sandbox.errors import ControlError, SandboxError

log = logging.getLogger("sandbox.netlinks")

# <linux/if_tun.h>, <linux/sockios.h>, <linux/if.h>, <linux/if_arp.h>
TUNSETIFF, TUNSETIFINDEX, TUNSETCARRIER = 0x400454CA, 0x400454DA, 0x400454E2
IFF_TAP, IFF_NO_PI, IFF_UP = 0x0002, 0x1000, 0x1
SIOCGIFFLAGS, SIOCSIFFLAGS, SIOCSIFMTU, SIOCSIFHWADDR = 0x8913, 0x8914, 0x8922, 0x8924
ARPHRD_ETHER = 1
CLONE_NEWNET = 0x40000000
# the fixed inode of the initial network namespace's nsfs file (proc_ns.h, Linux 6.x)
PROC_NET_INIT_INO, PROC_PID_INIT_INO = 0xEFFFFFF9, 0xEFFFFFFC


@dataclass(frozen=True)
class Link:
    """One netdev as the tree shows it."""

    name: str
    address: bytes | None  # 6 bytes for Ethernet; None where the tree's is not Ethernet's
    mtu: int
    carrier: bool
    ifindex: int


def tree_links(root: Path) -> dict[str, Link]:
    """The netdevs the tree at ``root`` shows in ``sys/class/net`` (loopback aside)."""
    links: dict[str, Link] = {}
    net = root / "sys/class/net"
    try:
        names = sorted(os.listdir(net))
    except FileNotFoundError:
        return links
    for name in names:
        if name == "lo":
            continue
        d = net / name
        try:
            kind = int(_read(d / "type"))
            text = _read(d / "address")
            links[name] = Link(
                name,
                bytes.fromhex(text.replace(":", "")) if kind == ARPHRD_ETHER else None,
                int(_read(d / "mtu")),
                _read(d / "carrier") == "1",
                int(_read(d / "ifindex")),
            )
        except FileNotFoundError:
            continue  # gone between the listing and the read: the next change says so
    return links


def _read(path: Path) -> str:
    return path.read_text().strip()


def is_host_netns(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` (an nsfs file such as /proc/self/ns/net or /run/netns/NAME) is the
    host's own network namespace: the initial one, known by its fixed inode or, on kernels
    without it, as PID 1's where this process sees the initial PID namespace."""
    ino = os.stat(path).st_ino
    if ino == PROC_NET_INIT_INO:
        return True
    try:
        if os.stat("/proc/self/ns/pid").st_ino == PROC_PID_INIT_INO:
            return ino == os.stat("/proc/1/ns/net").st_ino
    except OSError:
        pass
    return False


def enter_netns(path: str | os.PathLike[str]) -> None:
    """Move this (single-threaded) process into the network namespace at ``path``,
    refusing the host's own."""
    if is_host_netns(path):
        raise SandboxError(f"{path}: refusing the host's own network namespace (the "
                           "links are made only where a node's plugins run)")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns = getattr(os, "setns", None)  # Python >= 3.12
        if setns is not None:
            setns(fd, CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise SandboxError(f"{path}: cannot enter this network namespace: "
                               f"{os.strerror(err)}")
    finally:
        os.close(fd)


def _ifreq(name: str, payload: bytes = b"") -> bytes:
    return struct.pack("16s", name.encode()) + payload.ljust(24, b"\0")


class Links:
    """The TAP links this process holds, one per netdev name."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, Link]] = {}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def sync(self, wanted: Mapping[str, Link]) -> None:
        """Make the links what ``wanted`` says: new ones made, gone ones removed, MTU,
        address and carrier of the others set where they changed."""
        for name in list(self._held):
            fd, have = self._held[name]
            if name not in wanted or wanted[name].ifindex != have.ifindex:
                os.close(fd)  # not persistent: the kernel removes the link
                del self._held[name]
                log.info("removed %s", name)
        for name, link in wanted.items():
            try:
                if name in self._held:
                    self._update(self._held[name], link)
                else:
                    self._held[name] = (self._make(link), link)
                    log.info("made %s (ifindex %d)", name, link.ifindex)
            except OSError as e:  # one link the kernel refuses must not cost the others
                log.warning("%s: %s (tried again after the next change)", name, e)

    def close(self) -> None:
        for fd, _ in self._held.values():
            os.close(fd)
        self._held.clear()
        self._sock.close()

    def _make(self, link: Link) -> int:
        try:
            fd = self._tap(link.name, link.ifindex)
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.EEXIST):
                raise
            fd = self._tap(link.name, None)  # the index is taken here: let the kernel choose
            log.warning("%s: ifindex %d is taken in this namespace; the kernel chose another",
                        link.name, link.ifindex)
        try:
            if link.address is not None:
                self._set_address(link.name, link.address)
            self._set_mtu(link.name, link.mtu)
            flags = struct.unpack_from("H", fcntl.ioctl(self._sock, SIOCGIFFLAGS,
                                                        _ifreq(link.name)), 16)[0]
            fcntl.ioctl(self._sock, SIOCSIFFLAGS, _ifreq(link.name,
                                                         struct.pack("H", flags | IFF_UP)))
            # off, then on if the tree says so: the change is what makes operstate "up"
            # (a TAP starts "unknown")
            fcntl.ioctl(fd, TUNSETCARRIER, struct.pack("i", 0))
            if link.carrier:
                fcntl.ioctl(fd, TUNSETCARRIER, struct.pack("i", 1))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _set_address(self, name: str, address: bytes) -> None:
        fcntl.ioctl(self._sock, SIOCSIFHWADDR,
                    _ifreq(name, struct.pack("H", ARPHRD_ETHER) + address))

    def _set_mtu(self, name: str, mtu: int) -> None:
        fcntl.ioctl(self._sock, SIOCSIFMTU, _ifreq(name, struct.pack("i", mtu)))

    @staticmethod
    def _tap(name: str, ifindex: int | None) -> int:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
        try:
            if ifindex is not None:
                fcntl.ioctl(fd, TUNSETIFINDEX, struct.pack("I", ifindex))
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(),
                                                   IFF_TAP | IFF_NO_PI))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _update(self, held: tuple[int, Link], link: Link) -> None:
        fd, have = held
        if link.mtu != have.mtu:
            self._set_mtu(link.name, link.mtu)
        if link.address != have.address and link.address is not None:
            self._set_address(link.name, link.address)
        if link.carrier != have.carrier:
            fcntl.ioctl(fd, TUNSETCARRIER, struct.pack("i", int(link.carrier)))
            log.info("%s carrier %s", link.name, "on" if link.carrier else "off")
        self._held[link.name] = (fd, link)


def follow(root: Path, control: Path | None, links: Links, *, retry: float = 1.0) -> None:
    """Sync ``links`` with the tree now and after every change ``control`` reports; without
    a control socket (or while it is unreachable), every ``retry`` seconds."""
    from sandbox.fakehw.control import ControlClient

    while True:
        try:
            links.sync(tree_links(root))
            if control is None:
                time.sleep(retry)
                continue
            with ControlClient(control, timeout=None) as client:
                events = client.watch()
                links.sync(tree_links(root))  # what changed before the watch began
                for _ in events:
                    links.sync(tree_links(root))
        except (ControlError, OSError) as e:  # the server restarting, the mount gone
            log.warning("%s: %s; retrying in %.0f s", control or root, e, retry)
            time.sleep(retry)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sandbox.fakehw.netlinks",
        description="Hold real TAP links for the netdevs a served tree shows, in a node's "
                    "network namespace, following the tree's changes until stopped.")
    parser.add_argument("--root", type=Path, required=True, help="the served tree's root")
    parser.add_argument("--netns", required=True,
                        help="the network namespace to make them in (an nsfs path such as "
                             "/run/netns/NAME or /proc/PID/ns/net; never the host's)")
    parser.add_argument("--control", type=Path,
                        help="the tree's control socket (without it: re-read every second)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="netlinks: %(message)s")
    try:
        if not (args.root / "sys").is_dir():  # not yet served: followed once it is
            log.warning("%s: no sys/ here yet; waiting for the tree", args.root)
        enter_netns(args.netns)
        links = Links()
    except (SandboxError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        follow(args.root, args.control, links)
    except KeyboardInterrupt:
        pass
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        links.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
