"""Start moto's server mode on a free loopback port for a test module, and stop it afterwards.

moto keeps everything in memory; `reset()` empties it between tests. Dummy credentials only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

DUMMY_KEY_ID = "AKIAFAKEMOTOKEY00001"
DUMMY_SECRET = "fake-moto-secret-not-a-real-one-0001"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("moto_server")
        env = {**os.environ, "AWS_ACCESS_KEY_ID": DUMMY_KEY_ID, "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET}
        self.proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(self.port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.2)

    def reset(self) -> None:
        req = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10).read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def client_factory(url: str):
    """A `client_for(service, region)` that talks to moto with dummy credentials."""
    import boto3

    session = boto3.session.Session(aws_access_key_id=DUMMY_KEY_ID, aws_secret_access_key=DUMMY_SECRET)
    cache: dict = {}

    def client_for(service: str, region: str):
        if (service, region) not in cache:
            cache[(service, region)] = session.client(service, region_name=region, endpoint_url=url)
        return cache[(service, region)]

    return client_for
