"""Publishing a pool's ResourceSlices with the official ``kubernetes`` client.

Slices are sent as plain dicts through ``CustomObjectsApi`` (a path-generic client for any
API group): the typed models of an older client would silently drop fields they do not
know. A publish whose specs equal the last ones is a no-op; any change bumps the pool
generation (starting above whatever an earlier run of the driver left behind), updates
every slice of the pool to it and deletes slices the pool no longer needs.
``write_device_status`` records prepared devices in a claim's ``status.devices``.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from hwplugins.dra.slices import DRIVER, Pool, resource_slices, slice_specs
from hwplugins.dra.state import PreparedClaim

log = logging.getLogger("hwplugins.dra")

GROUP, VERSION, SLICES = "resource.k8s.io", "v1", "resourceslices"


_DROPPED_MEANS = {
    "DRADeviceCompatibilityGroups": "partitions of different modes may be co-allocated on "
    "one GPU; run without --compatibility-groups",
    "DRAOptionalNodeOperations": "the kubelet will call NodePrepareResources for the "
    "--skip-node-operations devices",
}


def dropped_alpha_fields(sent: dict[str, Any], got: dict[str, Any]) -> set[str]:
    """The alpha feature gates whose fields ``sent`` had and the server's answer ``got``
    lacks (an apiserver with the gate off drops them silently)."""
    gates = set()
    if sent["spec"].get("skipNodeOperations") and not got["spec"].get("skipNodeOperations"):
        gates.add("DRAOptionalNodeOperations")

    def groups(spec: dict[str, Any]) -> bool:
        return any(c.get("compatibilityGroups") for d in spec.get("devices") or []
                   for c in d.get("consumesCounters") or [])  # fmt: skip

    if groups(sent["spec"]) and not groups(got["spec"]):
        gates.add("DRADeviceCompatibilityGroups")
    return gates


class Publisher:
    def __init__(self, api: client.ApiClient, node: str, driver: str = DRIVER) -> None:
        self.objects = client.CustomObjectsApi(api)
        self.node = node
        self.driver = driver
        self.generation = 0
        self._last: list[dict[str, Any]] | None = None
        self._names: set[str] | None = None  # slices of our pool on the server

    def _existing(self) -> dict[str, dict[str, Any]]:
        listed = self.objects.list_cluster_custom_object(
            GROUP, VERSION, SLICES,
            field_selector=f"spec.nodeName={self.node},spec.driver={self.driver}",
        )  # fmt: skip
        return {item["metadata"]["name"]: item for item in listed.get("items", [])}

    def publish(self, pool: Pool) -> bool:
        """Make the server's slices describe ``pool``; True when anything was written."""
        specs = slice_specs(pool, self.node, self.driver)
        if specs == self._last:
            return False
        existing = self._existing()
        if self._names is None:  # first publish of this process: continue the generation
            self.generation = max(
                (int(s["spec"]["pool"]["generation"]) for s in existing.values()), default=0)
        self.generation += 1
        wanted = resource_slices(pool, self.node, self.generation, self.driver)
        dropped: set[str] = set()
        for obj in wanted:
            name = obj["metadata"]["name"]
            if name in existing:
                got = self.objects.replace_cluster_custom_object(GROUP, VERSION, SLICES, name,
                                                                 obj)  # fmt: skip
            else:
                got = self.objects.create_cluster_custom_object(GROUP, VERSION, SLICES, obj)
            dropped |= dropped_alpha_fields(obj, got)
        for gate in sorted(dropped):
            log.warning("the API server dropped the fields of feature gate %s from our slices "
                        "(gate off there): %s", gate, _DROPPED_MEANS[gate])  # fmt: skip
        names = {o["metadata"]["name"] for o in wanted}
        for name in sorted(set(existing) - names):
            try:
                self.objects.delete_cluster_custom_object(GROUP, VERSION, SLICES, name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        self._names = names
        self._last = specs
        log.info("published %d slice(s) of pool %s, generation %d (%d devices)",
                 len(wanted), self.node, self.generation, len(pool.devices))  # fmt: skip
        return True

    def forget(self) -> None:
        """Publish everything again on the next call (after an API error, say)."""
        self._last = None

    def delete_all(self) -> None:
        for name in sorted(self._existing()):
            try:
                self.objects.delete_cluster_custom_object(GROUP, VERSION, SLICES, name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        self._last = None


def read_claim(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    claim: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, "resourceclaims", name
    )
    return claim


def device_status(claim: dict[str, Any], prepared: PreparedClaim, pool: Pool,
                  driver: str = DRIVER, now: str | None = None,
                  ) -> list[dict[str, Any]]:  # fmt: skip
    """The claim's new ``status.devices``: other drivers' and pools' entries as they are,
    ours replaced by one per prepared device (condition Ready; a NIC's interface name)."""
    stamp = now or datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    pools = {d.pool_name for d in prepared.devices}
    out = [d for d in (claim.get("status") or {}).get("devices") or []
           if d.get("driver") != driver or d.get("pool") not in pools]  # fmt: skip
    for dev in prepared.devices:
        entry: dict[str, Any] = {"driver": driver, "pool": dev.pool_name,
                                 "device": dev.device_name}  # fmt: skip
        if dev.share_id:
            entry["shareID"] = dev.share_id
        entry["conditions"] = [{"type": "Ready", "status": "True", "reason": "Prepared",
                                "message": "CDI spec written by the node's driver",
                                "lastTransitionTime": stamp}]  # fmt: skip
        found = pool.device(dev.device_name)
        interface = next((v for k, v in found.source.attributes if k == "interface"),
                         None) if found is not None else None  # fmt: skip
        if isinstance(interface, str) and interface:
            entry["networkData"] = {"interfaceName": interface}
        out.append(entry)
    return out


def write_device_status(api: client.ApiClient, claim: dict[str, Any], prepared: PreparedClaim,
                        pool: Pool, driver: str = DRIVER) -> None:  # fmt: skip
    """Record the prepared devices in ``status.devices`` (an update of
    ``resourceclaims/status``; with DRAResourceClaimGranularStatusAuthorization, beta in
    1.37, it also needs ``associated-node:update`` on ``resourceclaims/driver`` named
    after the driver). Retries a conflicting update on a fresh read."""
    objects = client.CustomObjectsApi(api)
    meta = claim["metadata"]
    for attempt in range(3):
        body = {**claim, "status": {**(claim.get("status") or {}),
                                    "devices": device_status(claim, prepared, pool, driver)}}
        try:
            objects.replace_namespaced_custom_object_status(
                GROUP, VERSION, meta["namespace"], "resourceclaims", meta["name"], body)
            return
        except ApiException as exc:
            if exc.status != 409 or attempt == 2:
                raise
        claim = read_claim(api, meta["namespace"], meta["name"])
