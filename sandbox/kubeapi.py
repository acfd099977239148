"""The API server as plain JSON: the few reads and writes the runtimes make, over the
official client's kubeconfig loading (client certificates, tokens, exec plugins) and its
transport (urllib3), without its typed API classes.

Those classes build their pydantic models at import: ``CoreV1Api`` cost 0.5-0.8 s of CPU
here, ``AppsV1Api`` (which ``kubernetes.utils.create_from_yaml`` loads with the models of
every object it creates) as much again, while ``kubernetes.config`` and a request cost
~0.2 s. A ``sandbox status`` of a kind sandbox spent 0.84 s of its 1.2 s of CPU on that
import, and every ``up`` paid it while kubeadm wanted both cores. Objects here are the
API's JSON (dicts), as ``kubectl get -o json`` prints them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

TIMEOUT = 30.0  # seconds per request (connect and read)


class ApiError(Exception):
    """The API server answered with an error status (``status``: 404, 409, ...)."""

    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        super().__init__(f"{method} {path}: {status} {message}".strip())
        self.status = status


class Kube:
    """A client of one API server; ``close`` (or ``with``) releases its connections."""

    def __init__(self, configuration: Any) -> None:
        import urllib3

        self.host = str(configuration.host).rstrip("/")
        self.headers = {"Accept": "application/json", "User-Agent": "hw-sandbox"}
        for auth in configuration.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                self.headers[auth["key"]] = auth["value"]
        tls: dict[str, Any] = {}
        if self.host.startswith("https:"):
            tls = {"cert_reqs": "CERT_REQUIRED" if configuration.verify_ssl else "CERT_NONE",
                   "ca_certs": configuration.ssl_ca_cert, "cert_file": configuration.cert_file,
                   "key_file": configuration.key_file}
            if getattr(configuration, "tls_server_name", None):
                tls["server_hostname"] = configuration.tls_server_name
        self.pool = urllib3.PoolManager(num_pools=1, maxsize=4, retries=False,
                                        timeout=urllib3.Timeout(TIMEOUT), **tls)

    @classmethod
    def from_kubeconfig(cls, path: Path | str) -> Kube:
        from kubernetes import config
        from kubernetes.client.configuration import Configuration

        configuration = Configuration()
        config.load_kube_config(config_file=str(path), client_configuration=configuration)
        return cls(configuration)

    @classmethod
    def from_dict(cls, kubeconfig: dict[str, Any]) -> Kube:
        from kubernetes import config
        from kubernetes.client.configuration import Configuration

        configuration = Configuration()
        config.load_kube_config_from_dict(kubeconfig, client_configuration=configuration)
        return cls(configuration)

    def close(self) -> None:
        self.pool.clear()

    def __enter__(self) -> Kube:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json", timeout: float | None = None,
                **query: Any) -> bytes:
        """The reply's body; ApiError for an error status. ``query``: parameters with
        their API names (``labelSelector``, ``tailLines``, ...); None ones are left out."""
        import urllib3

        params = {k: str(v).lower() if isinstance(v, bool) else v
                  for k, v in query.items() if v is not None}
        url = self.host + path + (f"?{urlencode(params)}" if params else "")
        headers = dict(self.headers)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        reply = self.pool.request(method, url, body=data, headers=headers,
                                  timeout=urllib3.Timeout(timeout or TIMEOUT))
        if not 200 <= reply.status < 300:
            message = reply.data.decode(errors="replace")
            try:
                message = str(json.loads(message).get("message", message))
            except (ValueError, AttributeError):
                pass
            raise ApiError(method, path, reply.status, message.strip().splitlines()[0]
                           if message.strip() else "")
        return bytes(reply.data)

    def get(self, path: str, **query: Any) -> Any:
        return json.loads(self.request("GET", path, **query))

    def items(self, path: str, **query: Any) -> list[dict[str, Any]]:
        """A list's ``items`` (``path`` names a collection: ``/api/v1/nodes``)."""
        return [i for i in self.get(path, **query).get("items") or [] if isinstance(i, dict)]

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return json.loads(self.request("POST", path, body))

    def patch(self, path: str, body: dict[str, Any]) -> Any:
        """A JSON merge patch (RFC 7386)."""
        return json.loads(self.request("PATCH", path, body,
                                       content_type="application/merge-patch+json"))

    def log(self, namespace: str, pod: str, **query: Any) -> str:
        """A container's log (``container``, ``tailLines``, ``previous``)."""
        return self.request("GET", f"/api/v1/namespaces/{quote(namespace)}/pods/"
                            f"{quote(pod)}/log", **query).decode(errors="replace")

    def create(self, docs: list[dict[str, Any]]) -> None:
        """Create every object of ``docs`` (manifests, in order), as ``kubectl create``:
        where each kind lives comes from the API server's discovery of its group and
        version. ApiError on the first that fails (409: it exists)."""
        resources: dict[str, dict[str, tuple[str, bool]]] = {}
        for doc in docs:
            version = str(doc["apiVersion"])
            base = f"/api/{version}" if "/" not in version else f"/apis/{version}"
            if version not in resources:
                resources[version] = {
                    r["kind"]: (r["name"], bool(r.get("namespaced")))
                    for r in self.get(base).get("resources", []) if "/" not in r["name"]}
            kind = str(doc["kind"])
            if kind not in resources[version]:
                raise ApiError("POST", version, 404, f"the server has no {kind} in {version}")
            plural, namespaced = resources[version][kind]
            namespace = (doc.get("metadata") or {}).get("namespace") or "default"
            path = (f"{base}/namespaces/{quote(namespace)}/{plural}" if namespaced
                    else f"{base}/{plural}")
            self.post(path, doc)


def is_ready(node: dict[str, Any]) -> bool:
    """A Node (JSON) says Ready."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (node.get("status") or {}).get("conditions") or [])


def labels(obj: dict[str, Any]) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("labels") or {})


def name(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))
