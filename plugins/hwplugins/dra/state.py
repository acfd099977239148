"""Prepared claims: CDI spec files and the checkpoint that survives a driver restart.

``Claims.prepare`` turns a ResourceClaim's ``status.allocation`` (as read from the API
server) into one CDI spec file per claim and device class (``hwsandbox.dev/gpu``,
``/nic``, ``/fpga``), named ``hwsandbox.dev-<class>_<claim uid>.json``, whose devices
``<claim uid>-<device>`` carry the device nodes and env of the allocated devices. It is
idempotent: a claim already in the checkpoint is answered from it. The checkpoint (JSON,
written atomically) lists every prepared claim with its devices and files, so a restarted
driver still knows what to unprepare, even for a device that has since been unplugged.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hwplugins.dra.slices import DRIVER, Pool, PoolDevice

CDI_VERSION = "0.6.0"
CDI_VENDOR = "hwsandbox.dev"
CDI_CLASSES = {"gpu": "gpu", "gpu-partition": "gpu", "nic": "nic", "vf": "nic", "fpga": "fpga"}
CHECKPOINT_VERSION = 1


class PrepareError(Exception):
    """A claim that cannot be prepared; the message goes back to the kubelet."""


@dataclass(frozen=True)
class PreparedDevice:
    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]
    share_id: str | None = None


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: list[PreparedDevice]
    cdi_files: list[str] = field(default_factory=list)


def _container_edits(dev: PoolDevice, host_dev_dir: Path | None) -> dict[str, Any]:
    nodes = []
    for path in dev.source.dev_nodes:
        node: dict[str, Any] = {"path": path}
        if host_dev_dir is not None:
            node["hostPath"] = str(host_dev_dir / path.removeprefix("/dev/"))
        nodes.append(node)
    env = [f"{k}={v}" for k, v in dev.source.env]
    env.append(f"HWSANDBOX_DEVICE_{dev.name.upper().replace('-', '_')}={dev.name}")
    if dev.profile is not None:
        env.append(f"HWSANDBOX_PARTITION={dev.profile.name}")
    return {"env": env, "deviceNodes": nodes}


def _atomic_write(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class Claims:
    """Prepared claims of one driver on one node, backed by ``checkpoint``."""

    def __init__(self, checkpoint: Path, cdi_dir: Path, host_dev_dir: Path | None = None,
                 driver: str = DRIVER) -> None:  # fmt: skip
        self.checkpoint = checkpoint
        self.cdi_dir = cdi_dir
        self.host_dev_dir = host_dev_dir
        self.driver = driver
        self._lock = threading.Lock()
        self._claims: dict[str, PreparedClaim] = self._load()

    def _load(self) -> dict[str, PreparedClaim]:
        try:
            data = json.loads(self.checkpoint.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise PrepareError(f"checkpoint {self.checkpoint} unreadable: {exc}") from exc
        if data.get("version") != CHECKPOINT_VERSION:
            raise PrepareError(f"checkpoint {self.checkpoint}: unknown version "
                               f"{data.get('version')!r}")  # fmt: skip
        claims = {}
        for uid, c in data.get("claims", {}).items():
            devices = [PreparedDevice(**d) for d in c.pop("devices")]
            claims[uid] = PreparedClaim(devices=devices, **c)
        return claims

    def _save(self) -> None:
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.checkpoint, {
            "version": CHECKPOINT_VERSION,
            "claims": {uid: asdict(c) for uid, c in sorted(self._claims.items())},
        })  # fmt: skip

    def get(self, uid: str) -> PreparedClaim | None:
        with self._lock:
            return self._claims.get(uid)

    def all(self) -> dict[str, PreparedClaim]:
        with self._lock:
            return dict(self._claims)

    def prepare(self, claim: Mapping[str, Any], uid: str, pool: Pool,
                pool_name: str) -> PreparedClaim:  # fmt: skip
        """Prepare ``claim`` (the API object) for the kubelet; raises ``PrepareError``."""
        with self._lock:
            done = self._claims.get(uid)
            if done is not None:
                return done
            meta = claim.get("metadata", {})
            if meta.get("uid") != uid:
                raise PrepareError(f"claim {meta.get('namespace')}/{meta.get('name')} has uid "
                                   f"{meta.get('uid')}, the kubelet asked for {uid}")  # fmt: skip
            allocation = (claim.get("status") or {}).get("allocation")
            if not allocation:
                raise PrepareError(f"claim {meta.get('namespace')}/{meta.get('name')} "
                                   "is not allocated")  # fmt: skip
            results = [r for r in allocation.get("devices", {}).get("results", [])
                       if r.get("driver") == self.driver]  # fmt: skip
            per_class: dict[str, list[dict[str, Any]]] = {}
            devices = []
            for r in results:
                if r.get("pool") != pool_name:
                    raise PrepareError(f"device {r.get('pool')}/{r.get('device')} is in "
                                       f"another node's pool (this is {pool_name})")  # fmt: skip
                dev = pool.device(r["device"])
                if dev is None:
                    raise PrepareError(f"device {r['device']} is not on this node any more")
                cls = CDI_CLASSES[dev.type]
                share = r.get("shareID")
                cdi_name = f"{uid}-{dev.name}" + (f"-{share}" if share else "")
                per_class.setdefault(cls, []).append(
                    {"name": cdi_name, "containerEdits": _container_edits(dev, self.host_dev_dir)}
                )
                devices.append(PreparedDevice(
                    request_names=[r["request"]], pool_name=pool_name, device_name=dev.name,
                    cdi_device_ids=[f"{CDI_VENDOR}/{cls}={cdi_name}"], share_id=share,
                ))  # fmt: skip
            files = []
            self.cdi_dir.mkdir(parents=True, exist_ok=True)
            for cls, cdi_devices in sorted(per_class.items()):
                path = self.cdi_dir / f"{CDI_VENDOR}-{cls}_{uid}.json"
                _atomic_write(path, {"cdiVersion": CDI_VERSION, "kind": f"{CDI_VENDOR}/{cls}",
                                     "devices": cdi_devices})  # fmt: skip
                files.append(str(path))
            prepared = PreparedClaim(uid, str(meta.get("namespace", "")), str(meta.get("name")),
                                     devices, files)  # fmt: skip
            self._claims[uid] = prepared
            self._save()
            return prepared

    def unprepare(self, uid: str) -> None:
        """Remove the claim's CDI files and forget it; unknown claims are fine (idempotent)."""
        with self._lock:
            claim = self._claims.get(uid)
            if claim is None:
                return
            for name in claim.cdi_files:
                Path(name).unlink(missing_ok=True)
            del self._claims[uid]
            self._save()
