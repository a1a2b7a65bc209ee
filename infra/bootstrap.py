"""The VM startup script: install the project, wait for the run's assignment, start the worker agent.

Contract:
- `render_startup_script(cloud=..., install_spec=..., run_id=..., vm_name=...)` returns a bash
  script for cloud-init (AWS user data) or GCE's `startup-script` metadata key. It creates a venv,
  installs `install_spec` (a pip requirement such as `sailor-prefect[aws]==0.1.0`, a wheel URL or a
  git URL), then waits for the assignment: on AWS `bootstrap()` writes it to ASSIGNMENT_FILE
  through SSM Run Command (`assignment_commands`); on GCP the script reads it from the instance
  metadata attribute `sailor-assignment` (and keeps watching it: a new plan version's assignment
  restarts the agent). It then runs the runtime's worker in controlled mode
  (`python -m sailor_core.runtime.worker_proc --control <rendezvous> --worker-id <vm id>`, both from
  the assignment) under systemd, and a second unit, `python -m infra.metadata --exec ...`, that
  polls the metadata service (SAILOR_METADATA=aws|gcp) and SIGTERMs the worker on an imminent
  interruption notice, so it checkpoints just in time.
- The script carries no credentials: the VM's rights come from its instance role / service
  account. `render_startup_script` refuses an `env` that names secrets.
- Rendering is pure: the same arguments give the same script (tests compare it byte for byte).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Mapping

from infra.cloud import forbid_credentials
from infra.provider import WorkerAssignment

ASSIGNMENT_FILE = "/etc/sailor/assignment.json"
VENV = "/opt/sailor/venv"
GCP_ASSIGNMENT_KEY = "sailor-assignment"
GCP_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes"


def render_startup_script(
    *, cloud: str, install_spec: str, run_id: str, vm_name: str, env: Mapping[str, str] | None = None,
    python: str = "python3",
) -> str:
    if cloud not in ("aws", "gcp"):
        raise ValueError(f"cloud must be 'aws' or 'gcp', got {cloud!r}")
    env = dict(env or {})
    forbid_credentials(env, where=f"startup script of {vm_name}")
    env.update(SAILOR_RUN_ID=run_id, SAILOR_VM_NAME=vm_name, SAILOR_METADATA=cloud,
               SAILOR_ASSIGNMENT_FILE=ASSIGNMENT_FILE)
    env_lines = "\n".join(f"Environment={shlex.quote(f'{k}={v}')}" for k, v in sorted(env.items()))
    if cloud == "gcp":
        url = f"{GCP_METADATA_URL}/{GCP_ASSIGNMENT_KEY}"
        wait = f"""until curl -sf -H "Metadata-Flavor: Google" "{url}" -o {ASSIGNMENT_FILE}.tmp; do sleep 5; done
mv {ASSIGNMENT_FILE}.tmp {ASSIGNMENT_FILE}
# A new plan version sets a new assignment: install it and restart the agent (it checkpoints on SIGTERM).
cat > /opt/sailor/watch-assignment.sh <<'WATCH'
#!/bin/bash
while true; do
  if curl -sf -H "Metadata-Flavor: Google" "{url}?wait_for_change=true&timeout_sec=300" -o {ASSIGNMENT_FILE}.new \\
     && ! cmp -s {ASSIGNMENT_FILE}.new {ASSIGNMENT_FILE}; then
    mv {ASSIGNMENT_FILE}.new {ASSIGNMENT_FILE}
    systemctl restart sailor-worker.service
  fi
  sleep 1
done
WATCH
chmod +x /opt/sailor/watch-assignment.sh
nohup /opt/sailor/watch-assignment.sh >/var/log/sailor-assignment.log 2>&1 &"""
    else:
        wait = f"until [ -s {ASSIGNMENT_FILE} ]; do sleep 5; done  # written by SSM Run Command (bootstrap)"
    return f"""#!/bin/bash
# sailor startup script: run {run_id}, vm {vm_name}. Carries no credentials.
set -euo pipefail
exec > >(tee -a /var/log/sailor-startup.log) 2>&1
mkdir -p /etc/sailor /opt/sailor
if ! [ -x {VENV}/bin/sailor ]; then
  {python} -m venv {VENV}
  {VENV}/bin/pip install --quiet --upgrade pip
  {VENV}/bin/pip install --quiet {shlex.quote(install_spec)}
fi
{wait}
# The runtime's worker in controlled mode, under the VM's id, meeting the controller of the assignment.
cat > /opt/sailor/run-worker.sh <<'RUN'
#!/bin/bash
set -euo pipefail
read -r endpoint vm_id < <({VENV}/bin/python -c 'import json, sys; a = json.load(open(sys.argv[1])); print(a["rendezvous_endpoint"], a["vm_id"])' {ASSIGNMENT_FILE})
exec {VENV}/bin/python -m sailor_core.runtime.worker_proc --control "$endpoint" --worker-id "$vm_id"
RUN
chmod +x /opt/sailor/run-worker.sh
cat > /etc/systemd/system/sailor-worker.service <<'UNIT'
[Unit]
Description=sailor worker agent (run {run_id})
After=network-online.target
[Service]
{env_lines}
ExecStart=/opt/sailor/run-worker.sh
KillSignal=SIGTERM
TimeoutStopSec=110
Restart=on-failure
RestartSec=5
[Install]
WantedBy=multi-user.target
UNIT
# Interruption notices from the metadata service: SIGTERM the worker at once (it checkpoints on SIGTERM).
cat > /etc/systemd/system/sailor-notice.service <<'UNIT'
[Unit]
Description=sailor interruption-notice watcher (run {run_id})
After=network-online.target
[Service]
{env_lines}
ExecStart={VENV}/bin/python -m infra.metadata --exec "systemctl kill --signal=SIGTERM sailor-worker.service"
Restart=always
[Install]
WantedBy=multi-user.target
UNIT
systemctl daemon-reload
systemctl enable --now sailor-worker.service sailor-notice.service
"""


def assignment_json(assignment: WorkerAssignment, vm_id: str) -> str:
    """The assignment file on the VM: every WorkerAssignment field, plus the VM's id (its worker id)."""
    forbid_credentials(assignment.env, where=f"assignment of run {assignment.run_id}")
    return json.dumps({**dataclasses.asdict(assignment), "vm_id": vm_id}, sort_keys=True)


def assignment_commands(assignment: WorkerAssignment, vm_id: str) -> list[str]:
    """Shell commands (SSM AWS-RunShellScript) that install a new assignment and restart the agent."""
    body = assignment_json(assignment, vm_id)
    return [
        "mkdir -p /etc/sailor",
        f"printf '%s' {shlex.quote(body)} > {ASSIGNMENT_FILE}.tmp",
        f"mv {ASSIGNMENT_FILE}.tmp {ASSIGNMENT_FILE}",
        "systemctl restart sailor-worker.service || true",
    ]
