"""The driver process: rescan the root, publish the pool, serve the kubelet.

``Driver`` holds the current pool (discovery + config -> ``slices.build_pool``) and is the
kubelet plugin's backend: ``prepare`` reads the claim from the API server and hands it to
``state.Claims``. ``run`` is the loop: rescan when ``hwplugins.watch.Rescans`` says so
(every ``interval`` seconds, or on a live tree's change events), publish the slices when
they changed (a new pool generation), and keep the registration socket served.
An API server that is away is retried on the next round; the kubelet side keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from hwplugins.devices import Scanner
from hwplugins.dra.config import DriverConfig
from hwplugins.dra.discovery import from_scan
from hwplugins.dra.kubeletplugin import KubeletPlugin
from hwplugins.dra.publisher import Publisher
from hwplugins.dra.slices import DRIVER, Pool, build_pool
from hwplugins.dra.state import Claims, PreparedClaim, PrepareError
from hwplugins.watch import Rescans

log = logging.getLogger("hwplugins.dra")
TICK = 0.1  # how soon a change event or a stop is acted on
UNREGISTERED_WARNING = 30.0  # seconds without the kubelet's registration before a warning


class Driver:
    def __init__(self, root: Path, node: str, config: DriverConfig, claims: Claims,
                 read_claim: Callable[[str, str], dict[str, Any]] | None = None, *,
                 report: Callable[[dict[str, Any], PreparedClaim, Pool], None] | None = None,
                 compatibility_groups: bool = False, skip_node_operations: Collection[str] = (),
                 name: str = DRIVER) -> None:  # fmt: skip
        self.root = root
        self.node = node
        self.config = config
        self.claims = claims
        self.read_claim = read_claim
        self.report = report
        self.compatibility_groups = compatibility_groups
        self.skip_node_operations = tuple(skip_node_operations)
        self.name = name
        self._cond = threading.Condition()
        self._pool = Pool((), ())
        self._health: list[tuple[str, bool, str]] = []
        self._health_version = 0
        self._scanner = Scanner(root)

    @property
    def pool(self) -> Pool:
        with self._cond:
            return self._pool

    def rescan(self, dirty: frozenset[str] | None = None) -> Pool:
        """Scan again: everything, or only the PCI functions in ``dirty``."""
        devices = from_scan(self._scanner.scan(dirty))
        pool = build_pool(devices, self.config, self.compatibility_groups,
                          self.skip_node_operations)  # fmt: skip
        health = [(d.name, d.source.healthy, d.source.health.message) for d in pool.devices]
        with self._cond:
            self._pool = pool
            if health != self._health:
                self._health = health
                self._health_version += 1
                self._cond.notify_all()
        return pool

    # -- kubelet plugin backend ------------------------------------------------------------
    def prepare(self, namespace: str, uid: str, name: str) -> PreparedClaim:
        done = self.claims.get(uid)
        if done is not None:
            return done
        if self.read_claim is None:
            raise PrepareError("no API server configured: cannot read the claim")
        claim = self.read_claim(namespace, name)
        pool = self.pool
        prepared = self.claims.prepare(claim, uid, pool, self.node)
        if self.report is not None and prepared.devices:
            try:  # information for users: a refusal must not fail the pod
                self.report(claim, prepared, pool)
            except Exception as exc:
                log.warning("claim %s/%s: writing status.devices failed: %s",
                            namespace, name, getattr(exc, "reason", None) or exc)  # fmt: skip
        return prepared

    def unprepare(self, uid: str) -> None:
        self.claims.unprepare(uid)

    def wait_health(self, seen: int,
                    timeout: float) -> tuple[int, str, list[tuple[str, bool, str]]]:
        with self._cond:
            if self._health_version == seen:
                self._cond.wait(timeout)
            return self._health_version, self.node, list(self._health)


def run(driver: Driver, publisher: Publisher | None, plugin: KubeletPlugin | None,
        interval: float, stop: threading.Event,
        rescans: Rescans | None = None) -> None:  # fmt: skip
    """Rescan and publish when ``rescans`` says so (default: every ``interval`` seconds;
    see ``hwplugins.watch`` for following a live tree's change events); check the
    registration socket every ``interval`` seconds.

    With a kubelet plugin, nothing is published until the kubelet has registered the
    driver: a slice lets the scheduler allocate its devices at once, and a pod whose claim
    reaches the kubelet before the driver does fails to prepare ("DRA driver ... is not
    registered") and is retried only a minute or more later (in kind under load: 73-81 s
    for a pod applied as soon as the slices showed). Once published, later pools publish
    at once (a restarting kubelet registers the driver again; its slices stay)."""
    rescans = rescans or Rescans(interval)
    next_tick = 0.0
    pending: Pool | None = None  # scanned, not yet published
    gate = _RegistrationGate(plugin)
    if plugin is not None:
        plugin.start()
    try:
        while not stop.is_set():
            now = time.monotonic()
            rescan = rescans.due(now)
            if rescan is not None:
                pending = driver.rescan(rescan.dirty)
            if publisher is not None and pending is not None and gate.open(now):
                try:
                    publisher.publish(pending)
                except Exception as exc:  # the API server may be away: retry soon
                    log.warning("publishing slices failed: %s", exc)
                    publisher.forget()
                    rescans.retry(now)
                pending = None
            if plugin is not None and now >= next_tick:
                plugin.tick()
                next_tick = now + interval
            rescans.wait(min(TICK, interval))
    finally:
        rescans.close()
        if plugin is not None:
            plugin.stop()


class _RegistrationGate:
    """Open once the kubelet has registered the driver (at once without a kubelet plugin),
    then for good; says once why it waits, and warns if that lasts."""

    def __init__(self, plugin: KubeletPlugin | None) -> None:
        self.plugin = plugin
        self.opened = False
        self.since: float | None = None
        self.warned = False

    def open(self, now: float) -> bool:
        if self.opened or self.plugin is None or self.plugin.registered:
            self.opened = True
            return True
        if self.since is None:
            self.since = now
            log.info("waiting for the kubelet to register the driver before publishing slices")
        elif not self.warned and now - self.since >= UNREGISTERED_WARNING:
            self.warned = True
            log.warning("the kubelet has not registered the driver after %.0f s: no slices "
                        "are published until it does (does the kubelet watch %s?)",
                        now - self.since, self.plugin.registration_socket.parent)
        return False
