"""On-VM interruption notices from the instance metadata service, for the worker agent.

Contract:
- `AwsImdsPoller` speaks IMDSv2: it gets a session token (PUT /latest/api/token), then reads
  /latest/meta-data/spot/instance-action (404 = no notice; 200 = {"action", "time"}, the two-minute
  spot interruption notice) and /latest/meta-data/events/recommendations/rebalance (404 = none;
  200 = {"noticeTime"}). A 401 renews the token once.
- `GcpMetadataPoller` reads /computeMetadata/v1/instance/preempted ("TRUE" once a SPOT/preemptible
  VM is being preempted, about 30 s before it stops) and instance/maintenance-event, with the
  `Metadata-Flavor: Google` header.
- `poll()` returns the notices present now; `watch(poller, on_notice, stop)` polls until `stop`
  is set and calls `on_notice` once per new notice, so the agent can take a just-in-time
  checkpoint. Unreachable metadata (not on a VM, a hiccup) is not a notice: `poll` raises
  MetadataUnavailable and `watch` keeps polling.
- `poller_from_env(env)` picks the poller from SAILOR_METADATA (aws | gcp, set by the startup
  script); SAILOR_METADATA_URL overrides the base URL (tests point it at a local fake).
- `python -m infra.metadata --exec CMD` (the VM's notice unit) watches and runs CMD once on the
  first imminent notice (the startup script passes a command that SIGTERMs the worker).
Only the standard library (and sailor_core.errors); nothing here needs a cloud SDK or credentials.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from sailor_core.errors import MetadataUnavailable as MetadataUnavailable  # re-exported for tests

AWS_IMDS_URL = "http://169.254.169.254"
GCP_METADATA_URL = "http://metadata.google.internal"


@dataclass(frozen=True, kw_only=True)
class Notice:
    kind: str  # "spot-interruption" | "rebalance-recommendation" | "preempted" | "maintenance"
    action: str = ""  # terminate | stop | hibernate (AWS), or GCE's maintenance event
    at: datetime | None = None  # when the cloud will act, if it says
    raw: str = ""

    @property
    def imminent(self) -> bool:
        """The VM is going away: checkpoint now (a rebalance recommendation is only a warning)."""
        return self.kind in ("spot-interruption", "preempted") or (
            self.kind == "maintenance" and "TERMINATE" in self.action)


class Poller(Protocol):
    def poll(self) -> list[Notice]: ...


def _parse_time(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)
    except (ValueError, AttributeError):
        return None


def _request(url: str, *, method: str = "GET", headers: Mapping[str, str] | None = None,
             timeout_s: float = 2.0) -> tuple[int, str]:
    req = urllib.request.Request(url, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise MetadataUnavailable(f"metadata service at {url} did not answer: {e}") from e


@dataclass
class AwsImdsPoller:
    base_url: str = AWS_IMDS_URL
    token_ttl_s: int = 21600
    timeout_s: float = 2.0
    _token: str = field(default="", repr=False)

    def _get_token(self) -> str:
        code, body = _request(f"{self.base_url}/latest/api/token", method="PUT",
                              headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)},
                              timeout_s=self.timeout_s)
        if code != 200 or not body:
            raise MetadataUnavailable(f"IMDSv2 token request answered {code}")
        return body

    def _get(self, path: str) -> tuple[int, str]:
        if not self._token:
            self._token = self._get_token()
        code, body = _request(f"{self.base_url}{path}", headers={"X-aws-ec2-metadata-token": self._token},
                              timeout_s=self.timeout_s)
        if code == 401:  # token expired: renew once
            self._token = self._get_token()
            code, body = _request(f"{self.base_url}{path}", headers={"X-aws-ec2-metadata-token": self._token},
                                  timeout_s=self.timeout_s)
        return code, body

    def poll(self) -> list[Notice]:
        out = []
        code, body = self._get("/latest/meta-data/spot/instance-action")
        if code == 200:
            try:
                doc = json.loads(body)
            except ValueError:
                doc = {}
            out.append(Notice(kind="spot-interruption", action=str(doc.get("action", "terminate")),
                              at=_parse_time(str(doc.get("time", ""))), raw=body))
        elif code != 404:
            raise MetadataUnavailable(f"spot/instance-action answered {code}")
        code, body = self._get("/latest/meta-data/events/recommendations/rebalance")
        if code == 200:
            try:
                doc = json.loads(body)
            except ValueError:
                doc = {}
            out.append(Notice(kind="rebalance-recommendation", at=_parse_time(str(doc.get("noticeTime", ""))),
                              raw=body))
        elif code != 404:
            raise MetadataUnavailable(f"events/recommendations/rebalance answered {code}")
        return out


@dataclass
class GcpMetadataPoller:
    base_url: str = GCP_METADATA_URL
    timeout_s: float = 2.0

    def _get(self, path: str) -> str:
        code, body = _request(f"{self.base_url}/computeMetadata/v1/{path}", headers={"Metadata-Flavor": "Google"},
                              timeout_s=self.timeout_s)
        if code != 200:
            raise MetadataUnavailable(f"{path} answered {code}")
        return body.strip()

    def poll(self) -> list[Notice]:
        out = []
        if self._get("instance/preempted").upper() == "TRUE":
            out.append(Notice(kind="preempted", action="stop", raw="TRUE"))
        event = self._get("instance/maintenance-event")
        if event and event.upper() != "NONE":
            out.append(Notice(kind="maintenance", action=event, raw=event))
        return out


def watch(poller: Poller, on_notice: Callable[[Notice], None], stop: threading.Event, *,
          interval_s: float = 5.0, on_error: Callable[[Exception], None] | None = None) -> None:
    """Poll until `stop` is set; call `on_notice` once per distinct notice."""
    seen: set[tuple[str, str, str]] = set()
    while not stop.is_set():
        try:
            notices = poller.poll()
        except MetadataUnavailable as e:
            if on_error:
                on_error(e)
            notices = []
        for n in notices:
            key = (n.kind, n.action, n.raw)
            if key not in seen:
                seen.add(key)
                on_notice(n)
        stop.wait(interval_s)


def poller_from_env(env: Mapping[str, str]) -> Poller | None:
    """The poller for this VM's cloud (SAILOR_METADATA=aws|gcp), None off the clouds."""
    cloud = env.get("SAILOR_METADATA", "").lower()
    url = env.get("SAILOR_METADATA_URL", "")
    if cloud == "aws":
        return AwsImdsPoller(base_url=url or AWS_IMDS_URL)
    if cloud == "gcp":
        return GcpMetadataPoller(base_url=url or GCP_METADATA_URL)
    return None


def main(argv: list[str] | None = None) -> int:

    ap = argparse.ArgumentParser(prog="python -m infra.metadata", description="watch interruption notices")
    ap.add_argument("--exec", dest="command", required=True, help="shell command to run on an imminent notice")
    ap.add_argument("--interval-s", type=float, default=5.0)
    args = ap.parse_args(argv)
    poller = poller_from_env(os.environ)
    if poller is None:
        print("SAILOR_METADATA is not aws or gcp: nothing to watch", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_notice(n: Notice) -> None:
        print(f"notice: {n.kind} {n.action} at {n.at}", flush=True)
        if n.imminent:
            subprocess.run(args.command, shell=True, check=False)
            stop.set()

    watch(poller, on_notice, stop, interval_s=args.interval_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
