"""The VM bootstrap: one script installs the run's wheel and starts `sailor worker`, on every provider.

Contract:
- `AGENT_SCRIPT` (bash, the same bytes everywhere) is what runs on a VM once its assignment is there
  (`$SAILOR_ASSIGNMENT_FILE`, JSON, see `assignment_json`). It finds a Python >= 3.11 (installing
  python3.11 with the system's package manager when the image has none), creates a venv under
  `$SAILOR_HOME` (default /opt/sailor), downloads the run's wheel (`wheel_url`: s3:// through boto3
  with the VM's role, gs:// through gcloud, file:// or a path), checks its sha256 against the
  assignment, installs exactly that wheel, and `exec`s `sailor worker` with the assignment's controller,
  VM id, device count, log URI and advertised address, the run secret in `$SAILOR_RUN_SECRET` (or,
  when the assignment names a `command`, `sailor <command...>`: a one-off job such as profiling, whose
  output is kept as `jobs/<vm id>-<job>.log` under the log URI before its exit status is reported). A VM
  whose venv already holds that wheel skips the install. Where the image already carries the
  dependencies (the local testbed stands in for such an image: `$SAILOR_DEPS_SITE` names their
  site-packages), the wheel installs with `--no-deps`; elsewhere pip installs it with its `extras`.
- `render_startup_script(cloud=..., run_id=..., vm_name=...)` returns the cloud-init (AWS user data)
  or GCE `startup-script` around it: wait for the assignment (AWS: SSM Run Command writes
  ASSIGNMENT_FILE, `assignment_commands`; GCP: the instance metadata attribute `sailor-assignment`,
  watched for new versions), then run `AGENT_SCRIPT` under systemd, plus a unit that SIGTERMs it on an
  interruption notice from the metadata service (`python -m infra.metadata`).
- The scripts carry no credentials: the VM's rights come from its instance role / service account.
  What they write runs under `umask 077`: the assignment file (the run's secret) is 0600 in a 0700
  folder, readable by root only.
  `render_startup_script` refuses an `env` that names secrets. The run's secret (which only lets a
  worker talk to its own run's controller) travels in the assignment, never in a script.
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
SAILOR_HOME = "/opt/sailor"
VENV = f"{SAILOR_HOME}/venv"
AGENT_PATH = f"{SAILOR_HOME}/sailor-agent.sh"

AGENT_SCRIPT = r"""#!/bin/bash
# sailor agent bootstrap: install the run's wheel, then run `sailor worker`. Same script on every provider.
set -euo pipefail
: "${SAILOR_ASSIGNMENT_FILE:?the assignment file}"
home="${SAILOR_HOME:-/opt/sailor}"
mkdir -p "$home"
py="${SAILOR_PYTHON:-}"
for c in python3.13 python3.12 python3.11 python3; do
  [ -z "$py" ] || break
  if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    py=$(command -v "$c"); break
  fi
done
if [ -z "$py" ]; then  # an image whose Python is too old: install one
  if command -v apt-get >/dev/null; then apt-get update -q && apt-get install -y -q python3.11 python3.11-venv
  elif command -v dnf >/dev/null; then dnf install -y -q python3.11; fi
  py=$(command -v python3.11) || { echo "sailor: no Python >= 3.11 and none could be installed" >&2; exit 3; }
fi
field() {  # one field of the assignment; lists and mappings as JSON
  "$py" -c 'import json, sys; v = json.load(open(sys.argv[1])).get(sys.argv[2], "")
print(v if not isinstance(v, (list, dict)) else json.dumps(v))' "$SAILOR_ASSIGNMENT_FILE" "$1"
}
wheel_url=$(field wheel_url); want=$(field wheel_sha256)
venv="$home/venv"
if [ -n "$wheel_url" ] && [ "$(cat "$venv/.sailor-wheel" 2>/dev/null)" != "$want" ]; then
  rm -rf "$venv" "$home/wheel"; mkdir -p "$home/wheel"
  dest="$home/wheel/$(basename "${wheel_url%%\?*}")"
  if [ -n "${SAILOR_DEPS_SITE:-}" ]; then
    "$py" -m venv --without-pip "$venv"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$SAILOR_DEPS_SITE" > "$site/sailor-deps.pth"
    pip=("$venv/bin/python" -m pip install -q --no-deps --no-index)
  else
    "$py" -m venv "$venv"; "$venv/bin/pip" install -q --upgrade pip boto3
    pip=("$venv/bin/pip" install -q)
  fi
  case "$wheel_url" in
    s3://*) "$venv/bin/python" -c 'import boto3, sys; b, _, k = sys.argv[1][5:].partition("/")
boto3.client("s3").download_file(b, k, sys.argv[2])' "$wheel_url" "$dest" ;;
    gs://*) gcloud storage cp "$wheel_url" "$dest" ;;
    *) cp "${wheel_url#file://}" "$dest" ;;
  esac
  got=$(sha256sum "$dest" | cut -d" " -f1)
  [ "$got" = "$want" ] || { echo "sailor: wheel $wheel_url has sha256 $got, the run expects $want" >&2; exit 3; }
  extras=$(field extras)
  "${pip[@]}" "$dest${extras:+[$extras]}"
  echo "$want" > "$venv/.sailor-wheel"
fi
bin="$venv/bin"; [ -x "$bin/sailor" ] || bin="$(dirname "$py")"
addr=$(field advertise_address); [ -n "$addr" ] || addr=$(hostname -I 2>/dev/null | cut -d" " -f1)
SAILOR_RUN_SECRET=$(field run_secret); export SAILOR_RUN_SECRET
SAILOR_CONTROL=$(field rendezvous_endpoint); SAILOR_VM_ID=$(field vm_id); SAILOR_ADVERTISE_ADDR="${addr:-127.0.0.1}"
export SAILOR_CONTROL SAILOR_VM_ID SAILOR_ADVERTISE_ADDR
if [ "$(field command)" != "" ] && [ "$(field command)" != "[]" ]; then  # a one-off job (e.g. profiling)
  mapfile -t cmd < <("$py" -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))["command"]))' \
    "$SAILOR_ASSIGNMENT_FILE")
  out="$home/job-$(field plan_version)"
  rc=0; "$bin/sailor" "${cmd[@]}" >"$out.stdout" 2>"$out.stderr" || rc=$?
  cat "$out.stdout"; cat "$out.stderr" >&2
  pyrun="$bin/python"; [ -x "$pyrun" ] || pyrun="$py"
  if [ -n "$(field log_uri)" ]; then  # the command's output, kept under the run's logs (jobs/VM-JOB.log)
    "$pyrun" -c 'import sys; from sailor_core.uris import filesystem_for, is_local
fs, root = filesystem_for(sys.argv[1])
if is_local(sys.argv[1]): fs.create_dir(root + "/jobs", recursive=True)  # object stores have no folders
with fs.open_output_stream(root + "/jobs/" + sys.argv[2]) as f:
    f.write(b"".join(open(p, "rb").read() for p in sys.argv[3:]))' "$(field log_uri)" \
      "$SAILOR_VM_ID-$(field plan_version).log" "$out.stdout" "$out.stderr" || echo "sailor: output not kept" >&2
  fi
  "$pyrun" -m sailor_core.runtime.protocol set "jobs/$SAILOR_VM_ID/$(field plan_version)" "$rc"  # job_key
  exit "$rc"
fi
exec "$bin/sailor" worker --control "$(field rendezvous_endpoint)" --vm-id "$(field vm_id)" \
  --devices "$(field devices)" --run-dir "$home/vm" --log-uri "$(field log_uri)" \
  --advertise-addr "${addr:-127.0.0.1}" --first-generation "$(field first_generation)"
"""
GCP_ASSIGNMENT_KEY = "sailor-assignment"
GCP_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes"


def render_startup_script(
    *, cloud: str, run_id: str, vm_name: str, env: Mapping[str, str] | None = None,
) -> str:
    """The cloud's startup script (what to install comes later, with the assignment: the run's wheel)."""
    if cloud not in ("aws", "gcp"):
        raise ValueError(f"cloud must be 'aws' or 'gcp', got {cloud!r}")
    env = dict(env or {})
    forbid_credentials(env, where=f"startup script of {vm_name}")
    env.update(SAILOR_RUN_ID=run_id, SAILOR_VM_NAME=vm_name, SAILOR_METADATA=cloud,
               SAILOR_ASSIGNMENT_FILE=ASSIGNMENT_FILE, SAILOR_HOME=SAILOR_HOME)
    env_lines = "\n".join(f"Environment={shlex.quote(f'{k}={v}')}" for k, v in sorted(env.items()))
    if cloud == "gcp":
        url = f"{GCP_METADATA_URL}/{GCP_ASSIGNMENT_KEY}"
        wait = f"""until curl -sf -H "Metadata-Flavor: Google" "{url}" -o {ASSIGNMENT_FILE}.tmp; do sleep 5; done
mv {ASSIGNMENT_FILE}.tmp {ASSIGNMENT_FILE}
# A new plan version sets a new assignment: install it and restart the agent (it checkpoints on SIGTERM).
cat > {SAILOR_HOME}/watch-assignment.sh <<'WATCH'
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
chmod +x {SAILOR_HOME}/watch-assignment.sh
nohup {SAILOR_HOME}/watch-assignment.sh >/var/log/sailor-assignment.log 2>&1 &"""
    else:
        wait = f"until [ -s {ASSIGNMENT_FILE} ]; do sleep 5; done  # written by SSM Run Command (bootstrap)"
    return f"""#!/bin/bash
# sailor startup script: run {run_id}, vm {vm_name}. Carries no credentials.
set -euo pipefail
umask 077  # the assignment holds the run's secret: nothing written here is readable by other users
exec > >(tee -a /var/log/sailor-startup.log) 2>&1
mkdir -p /etc/sailor {SAILOR_HOME}
cat > {AGENT_PATH} <<'AGENT'
{AGENT_SCRIPT}AGENT
chmod +x {AGENT_PATH}
{wait}
# The agent: installs the run's wheel from the assignment, then runs `sailor worker` (one worker per GPU).
cat > /etc/systemd/system/sailor-worker.service <<'UNIT'
[Unit]
Description=sailor worker agent (run {run_id})
After=network-online.target
[Service]
{env_lines}
ExecStart=/bin/bash {AGENT_PATH}
KillSignal=SIGTERM
TimeoutStopSec=110
Restart=on-failure
RestartSec=5
[Install]
WantedBy=multi-user.target
UNIT
# Interruption notices from the metadata service: SIGTERM the agent at once (its workers checkpoint on SIGTERM).
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
        "umask 077",  # the assignment holds the run's secret: 0600 in a 0700 folder
        "mkdir -p /etc/sailor && chmod 700 /etc/sailor",
        f"printf '%s' {shlex.quote(body)} > {ASSIGNMENT_FILE}.tmp",
        f"mv {ASSIGNMENT_FILE}.tmp {ASSIGNMENT_FILE}",
        "systemctl restart sailor-worker.service || true",
    ]
