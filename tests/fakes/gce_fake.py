"""A small stdlib HTTP fake of the Compute Engine REST API (v1), enough for the GCP provider's tests.

Served paths (project-scoped, JSON, camelCase like the real API):
  zones list/get; regions list/get (with GPU quotas); zones/Z/acceleratorTypes list;
  zones/Z/machineTypes list/get; zones/Z/instances insert/get/list/delete/setMetadata;
  aggregated/instances; zones/Z/operations get/list/wait; global/firewalls insert/get/list/delete;
  global/operations get/wait. List calls accept the simple filters the provider sends:
  `field = "value"` terms (dotted paths such as labels.sailor-run), joined by AND.
Behaviour a test controls from Python (the fake runs in a thread of the test process):
  `exhausted` zones (or (zone, machine type) pairs) make inserts finish with
  ZONE_RESOURCE_POOL_EXHAUSTED like GCE does (HTTP 503 in the operation); regional GPU quotas
  (`quotas`, usage counted from live instances) make inserts finish with QUOTA_EXCEEDED (403) and
  are reported with their usage by regions.get; `preempt(zone, name)`
  stops a SPOT instance and records a `compute.instances.preempted` zone operation; `requests`
  records every call (method, path, body) so tests can read exactly what was sent.
Anything else answers 404 with a GCE-shaped error. Bad bodies answer 400 (BadRequest in the SDK).
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

BASE = "https://www.googleapis.com/compute/v1"

DEFAULT_ZONES: dict[str, list[str]] = {
    # zone -> accelerator types it has
    "us-central1-a": ["nvidia-tesla-a100", "nvidia-h100-80gb", "nvidia-l4", "nvidia-tesla-v100", "nvidia-tesla-t4"],
    "us-central1-b": ["nvidia-tesla-a100", "nvidia-l4", "nvidia-tesla-v100", "nvidia-tesla-t4"],
    "us-central1-c": ["nvidia-l4", "nvidia-tesla-t4"],
    "europe-west4-a": ["nvidia-tesla-a100", "nvidia-a100-80gb", "nvidia-h100-80gb", "nvidia-l4",
                       "nvidia-tesla-v100", "nvidia-tesla-t4"],
    "europe-west4-b": ["nvidia-l4", "nvidia-tesla-v100", "nvidia-tesla-t4"],
}
DEFAULT_QUOTAS: dict[str, dict[str, float]] = {
    "us-central1": {"NVIDIA_A100_GPUS": 16, "PREEMPTIBLE_NVIDIA_A100_GPUS": 32, "NVIDIA_L4_GPUS": 8,
                    "PREEMPTIBLE_NVIDIA_L4_GPUS": 16, "NVIDIA_V100_GPUS": 8, "PREEMPTIBLE_NVIDIA_V100_GPUS": 8,
                    "NVIDIA_T4_GPUS": 4, "PREEMPTIBLE_NVIDIA_T4_GPUS": 4, "NVIDIA_H100_GPUS": 0,
                    "PREEMPTIBLE_NVIDIA_H100_GPUS": 8},
    "europe-west4": {"NVIDIA_A100_GPUS": 8, "PREEMPTIBLE_NVIDIA_A100_GPUS": 8, "NVIDIA_A100_80GB_GPUS": 8,
                     "PREEMPTIBLE_NVIDIA_A100_80GB_GPUS": 8, "NVIDIA_L4_GPUS": 4, "PREEMPTIBLE_NVIDIA_L4_GPUS": 4,
                     "NVIDIA_V100_GPUS": 4, "PREEMPTIBLE_NVIDIA_V100_GPUS": 4, "NVIDIA_T4_GPUS": 4,
                     "PREEMPTIBLE_NVIDIA_T4_GPUS": 4, "NVIDIA_H100_GPUS": 8, "PREEMPTIBLE_NVIDIA_H100_GPUS": 8},
}


QUOTA_METRIC = {"nvidia-tesla-a100": "NVIDIA_A100_GPUS", "nvidia-a100-80gb": "NVIDIA_A100_80GB_GPUS",
                "nvidia-h100-80gb": "NVIDIA_H100_GPUS", "nvidia-l4": "NVIDIA_L4_GPUS",
                "nvidia-tesla-v100": "NVIDIA_V100_GPUS", "nvidia-tesla-t4": "NVIDIA_T4_GPUS"}
_G2_GPUS = {"4": 1, "8": 1, "12": 1, "16": 1, "32": 1, "24": 2, "48": 4, "96": 8}


def gpus_of(machine_type: str, body: dict[str, Any]) -> tuple[str, int]:
    """(accelerator type, count) of an instance: built into a2/a3/g2 types, attached on N1."""
    for acc in body.get("guestAccelerators", []):
        return acc.get("acceleratorType", "").rsplit("/", 1)[-1], int(acc.get("acceleratorCount", 0))
    fam, _, rest = machine_type.partition("-")
    kind, _, size = rest.partition("-")
    if fam == "a2":
        n = int(size.rstrip("g") or 0)
        return ("nvidia-a100-80gb" if kind == "ultragpu" else "nvidia-tesla-a100"), n
    if fam == "a3":
        return "nvidia-h100-80gb", int(size.rstrip("g") or 0)
    if fam == "g2":
        return "nvidia-l4", _G2_GPUS.get(size, 0)
    return "", 0


def quota_metric(machine_type: str, body: dict[str, Any]) -> tuple[str, int]:
    acc, n = gpus_of(machine_type, body)
    if not acc:
        return "", 0
    spot = body.get("scheduling", {}).get("provisioningModel") == "SPOT"
    return ("PREEMPTIBLE_" if spot else "") + QUOTA_METRIC[acc], n


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _region(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def matches(obj: dict[str, Any], flt: str) -> bool:
    """GCE list filter, the subset used here: `a.b = "v"` / `a != "v"` terms joined by AND."""
    if not flt.strip():
        return True
    for term in re.split(r"\s+AND\s+", flt.strip()):
        term = term.strip().strip("()").strip()
        m = re.fullmatch(r'([\w.\-]+)\s*(=|!=|eq|ne)\s*"?([^"]*)"?', term)
        if not m:
            raise ValueError(f"unsupported filter term {term!r}")
        field, op, value = m.groups()
        got = _get(obj, field)
        equal = str(got) == value if got is not None else False
        if (op in ("=", "eq")) != equal:
            return False
    return True


class GceFake:
    def __init__(self, project: str = "sailor-test", zones: dict[str, list[str]] | None = None,
                 quotas: dict[str, dict[str, float]] | None = None) -> None:
        self.project = project
        self.zones = dict(zones or DEFAULT_ZONES)
        self.quotas = {k: dict(v) for k, v in (quotas or DEFAULT_QUOTAS).items()}
        self.instances: dict[tuple[str, str], dict[str, Any]] = {}
        self.operations: dict[str, dict[str, Any]] = {}  # name -> op (zone ops carry "zone")
        self.firewalls: dict[str, dict[str, Any]] = {}
        self.exhausted: set[Any] = set()
        self.requests: list[tuple[str, str, Any]] = []
        self._ids = itertools.count(1000)
        self._ips = itertools.count(2)
        self.lock = threading.RLock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> GceFake:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def reset(self) -> None:
        with self.lock:
            self.instances.clear()
            self.operations.clear()
            self.firewalls.clear()
            self.exhausted.clear()
            self.requests.clear()

    # -- state changes a test drives -----------------------------------------------------------
    def preempt(self, zone: str, name: str) -> None:
        with self.lock:
            inst = self.instances[(zone, name)]
            if inst.get("scheduling", {}).get("provisioningModel") != "SPOT":
                raise ValueError(f"{name} is not a SPOT VM; only those are preempted")
            self._op(zone, "compute.instances.preempted", inst["selfLink"], target_id=inst["id"])
            if inst.get("scheduling", {}).get("instanceTerminationAction") == "DELETE":
                del self.instances[(zone, name)]
            else:
                inst["status"] = "TERMINATED"

    def live_instances(self) -> list[dict[str, Any]]:
        with self.lock:
            return [i for i in self.instances.values() if i["status"] not in ("TERMINATED", "STOPPED")]

    # -- resources -----------------------------------------------------------------------------
    def _op(self, zone: str | None, kind: str, target: str, *, error: dict[str, Any] | None = None,
            target_id: str = "") -> dict[str, Any]:
        name = f"operation-{next(self._ids)}"
        where = f"{BASE}/projects/{self.project}/" + (f"zones/{zone}" if zone else "global")
        op: dict[str, Any] = {
            "kind": "compute#operation", "id": str(next(self._ids)), "name": name, "operationType": kind,
            "targetLink": target, "status": "DONE", "progress": 100,
            "insertTime": _now(), "startTime": _now(), "endTime": _now(), "selfLink": f"{where}/operations/{name}",
        }
        if target_id:
            op["targetId"] = target_id
        if zone:
            op["zone"] = f"{BASE}/projects/{self.project}/zones/{zone}"
        if error:
            op["error"] = {"errors": [error]}
            op["httpErrorStatusCode"] = {"ZONE_RESOURCE_POOL_EXHAUSTED": 503, "QUOTA_EXCEEDED": 403}.get(
                error["code"], 400
            )
            op["httpErrorMessage"] = {503: "SERVICE UNAVAILABLE", 403: "FORBIDDEN"}.get(op["httpErrorStatusCode"],
                                                                                       "BAD REQUEST")
        self.operations[name] = op
        return op

    def _insert_instance(self, zone: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("name", "")
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name):
            raise BadRequest(f"Invalid value for field 'resource.name': '{name}'")
        mt = body.get("machineType", "").rsplit("/", 1)[-1]
        if not mt:
            raise BadRequest("Invalid value for field 'resource.machineType': ''")
        link = f"{BASE}/projects/{self.project}/zones/{zone}/instances/{name}"
        for acc in body.get("guestAccelerators", []):
            kind = acc.get("acceleratorType", "").rsplit("/", 1)[-1]
            if kind not in self.zones.get(zone, []):
                raise BadRequest(f"Accelerator type '{kind}' is not available in zone {zone}")
        if zone in self.exhausted or (zone, mt) in self.exhausted:
            return self._op(zone, "insert", link, error={
                "code": "ZONE_RESOURCE_POOL_EXHAUSTED",
                "message": f"The zone 'projects/{self.project}/zones/{zone}' does not have enough resources "
                           f"available to fulfill the request. Try a different zone, or try again later."})
        if (zone, name) in self.instances:
            raise Conflict(f"The resource '{link}' already exists")
        metric, gpus = quota_metric(mt, body)
        region = _region(zone)
        if metric and metric in self.quotas.get(region, {}):
            limit = self.quotas[region][metric]
            if self._usage(region, metric) + gpus > limit:
                return self._op(zone, "insert", link, error={
                    "code": "QUOTA_EXCEEDED",
                    "message": f"Quota '{metric}' exceeded.  Limit: {limit} in region {region}."})
        n = next(self._ips)
        inst = dict(body)
        inst.update({
            "kind": "compute#instance", "id": str(next(self._ids)), "status": "RUNNING", "selfLink": link,
            "zone": f"{BASE}/projects/{self.project}/zones/{zone}", "creationTimestamp": _now(),
            "machineType": f"{BASE}/projects/{self.project}/zones/{zone}/machineTypes/{mt}",
        })
        inst.setdefault("metadata", {})["fingerprint"] = f"fp-{next(self._ids)}"
        nics = inst.get("networkInterfaces") or [{}]
        for nic in nics:
            nic["networkIP"] = f"10.128.0.{n}"
            for ac in nic.get("accessConfigs", []):
                ac["natIP"] = f"34.0.0.{n}"
        inst["networkInterfaces"] = nics
        self.instances[(zone, name)] = inst
        return self._op(zone, "insert", link, target_id=inst["id"])

    # -- HTTP ----------------------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                url = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                body = None
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    try:
                        body = json.loads(self.rfile.read(length))
                    except ValueError:
                        return self._send(400, _error(400, "Invalid JSON payload received."))
                with fake.lock:
                    fake.requests.append((method, url.path, body))
                    try:
                        code, obj = fake.route(method, url.path, q, body)
                    except BadRequest as e:
                        code, obj = 400, _error(400, str(e))
                    except Conflict as e:
                        code, obj = 409, _error(409, str(e))
                    except KeyError as e:
                        code, obj = 404, _error(404, f"The resource {e} was not found")
                self._send(code, obj)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

            def do_PATCH(self) -> None:
                self._handle("PATCH")

        return Handler

    def route(self, method: str, path: str, q: dict[str, str], body: Any) -> tuple[int, Any]:
        prefix = f"/compute/v1/projects/{self.project}/"
        if not path.startswith(prefix):
            raise KeyError(path)
        parts = path[len(prefix):].split("/")
        flt = q.get("filter", "")
        p = f"{BASE}/projects/{self.project}"
        if parts == ["zones"]:
            return 200, {"items": [self._zone(z) for z in sorted(self.zones) if matches(self._zone(z), flt)]}
        if parts[0] == "zones" and len(parts) == 2:
            if parts[1] not in self.zones:
                raise KeyError(parts[1])
            return 200, self._zone(parts[1])
        if parts == ["regions"]:
            return 200, {"items": [self._region_obj(r) for r in sorted(self.quotas)]}
        if parts[0] == "regions" and len(parts) == 2:
            if parts[1] not in self.quotas:
                raise KeyError(parts[1])
            return 200, self._region_obj(parts[1])
        if parts == ["aggregated", "instances"]:
            items: dict[str, Any] = {}
            for (zone, _), inst in sorted(self.instances.items()):
                if matches(inst, flt):
                    items.setdefault(f"zones/{zone}", {"instances": []})["instances"].append(inst)
            return 200, {"items": items}
        if parts[0] == "global" and parts[1] == "firewalls":
            if method == "POST" and len(parts) == 2:
                name = body.get("name", "")
                if name in self.firewalls:
                    raise Conflict(f"firewall {name} already exists")
                fw = dict(body, id=str(next(self._ids)), selfLink=f"{p}/global/firewalls/{name}",
                          creationTimestamp=_now())
                fw.setdefault("network", f"{p}/global/networks/default")
                self.firewalls[name] = fw
                return 200, self._op(None, "insert", fw["selfLink"])
            if method == "GET" and len(parts) == 2:
                return 200, {"items": [f for f in self.firewalls.values() if matches(f, flt)]}
            name = parts[2]
            if method == "GET":
                return 200, self.firewalls[name]
            if method == "DELETE":
                fw = self.firewalls.pop(name)
                return 200, self._op(None, "delete", fw["selfLink"])
        if parts[0] == "global" and parts[1] == "operations":
            return 200, self.operations[parts[2]]
        if parts[0] == "zones" and len(parts) >= 3:
            zone, kind = parts[1], parts[2]
            if zone not in self.zones:
                raise KeyError(zone)
            if kind == "acceleratorTypes":
                return 200, {"items": [{"kind": "compute#acceleratorType", "name": a, "zone": f"{p}/zones/{zone}",
                                        "maximumCardsPerInstance": 8,
                                        "selfLink": f"{p}/zones/{zone}/acceleratorTypes/{a}"}
                                       for a in self.zones[zone]]}
            if kind == "machineTypes":
                if len(parts) == 4:
                    return 200, {"name": parts[3], "zone": zone}
                return 200, {"items": []}
            if kind == "operations":
                if len(parts) == 3:
                    ops = [o for o in self.operations.values() if o.get("zone", "").endswith(f"/zones/{zone}")]
                    return 200, {"items": [o for o in ops if matches(o, flt)]}
                return 200, self.operations[parts[3]]
            if kind == "instances":
                if len(parts) == 3 and method == "POST":
                    if not isinstance(body, dict):
                        raise BadRequest("instance body required")
                    return 200, self._insert_instance(zone, body)
                if len(parts) == 3:
                    return 200, {"items": [i for (z, _), i in sorted(self.instances.items())
                                           if z == zone and matches(i, flt)]}
                name = parts[3]
                inst = self.instances[(zone, name)]
                if len(parts) == 5 and parts[4] == "setMetadata" and method == "POST":
                    if body.get("fingerprint") != inst["metadata"].get("fingerprint"):
                        raise BadRequest("Supplied fingerprint does not match current metadata fingerprint.")
                    inst["metadata"] = {"items": body.get("items", []), "fingerprint": f"fp-{next(self._ids)}"}
                    return 200, self._op(zone, "setMetadata", inst["selfLink"], target_id=inst["id"])
                if method == "GET":
                    return 200, inst
                if method == "DELETE":
                    del self.instances[(zone, name)]
                    return 200, self._op(zone, "delete", inst["selfLink"], target_id=inst["id"])
        raise KeyError(path)

    def _usage(self, region: str, metric: str) -> float:
        used = 0.0
        for (zone, _), inst in self.instances.items():
            if _region(zone) == region and inst["status"] not in ("TERMINATED", "STOPPED"):
                m, n = quota_metric(inst["machineType"].rsplit("/", 1)[-1], inst)
                used += n if m == metric else 0
        return used

    def _zone(self, z: str) -> dict[str, Any]:
        p = f"{BASE}/projects/{self.project}"
        return {"kind": "compute#zone", "name": z, "status": "UP", "region": f"{p}/regions/{_region(z)}",
                "selfLink": f"{p}/zones/{z}"}

    def _region_obj(self, r: str) -> dict[str, Any]:
        p = f"{BASE}/projects/{self.project}"
        return {"kind": "compute#region", "name": r, "status": "UP", "selfLink": f"{p}/regions/{r}",
                "zones": [f"{p}/zones/{z}" for z in sorted(self.zones) if _region(z) == r],
                "quotas": [{"metric": m, "limit": lim, "usage": self._usage(r, m)}
                           for m, lim in sorted(self.quotas[r].items())]}


class BadRequest(Exception):
    pass


class Conflict(Exception):
    pass


def _error(code: int, message: str) -> dict[str, Any]:
    reason = {400: "invalid", 404: "notFound", 409: "alreadyExists"}.get(code, "error")
    return {"error": {"code": code, "message": message, "errors": [{"message": message, "domain": "global",
                                                                    "reason": reason}]}}


if __name__ == "__main__":  # python -m tests.fakes.gce_fake: serve until interrupted
    f = GceFake().start()
    print(f.endpoint, flush=True)
    try:
        f._thread.join()
    except KeyboardInterrupt:
        f.stop()
