#!/usr/bin/env bash
# What launch_gpu_vm.sh and launch_tpu_vm.sh share: printing or running commands, finding the gin
# preset and the jax version, and the scripts they run on the machine. Sourced, not run:
#
#   # shellcheck source-path=SCRIPTDIR source=launch_common.sh
#   source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
#
# The caller defines die MESSAGE (exit 2 with the message) and DRY_RUN (1: print, 0: run).

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then  # run, not sourced: only a usage line
  echo "usage: source scripts/launch_common.sh (from launch_gpu_vm.sh and launch_tpu_vm.sh; see their --help)"
  [[ "${1:-}" == -h || "${1:-}" == --help ]] && exit 0
  exit 2
fi

# Print (dry run) or run one command. Printed commands are exact and shell-quoted, one per line.
run() {
  if (( DRY_RUN )); then
    local out="+" arg
    for arg in "$@"; do out+=" $(printf '%q' "$arg")"; done
    printf '%s\n' "$out"
  else
    "$@"
  fi
}
# Run a command whose last argument is a multi-line remote script: FLAG is how the script is passed
# ("--command=" for gcloud, "" for plain ssh). A dry run prints it as a quoted heredoc, still exact.
run_remote() {  # run_remote FLAG SCRIPT CMD...
  local flag="$1" script="$2"
  shift 2
  if (( DRY_RUN )); then
    local out="+" arg
    for arg in "$@"; do out+=" $(printf '%q' "$arg")"; done
    # shellcheck disable=SC2016  # the $(cat ...) is printed, not run
    printf '%s %s"$(cat <<'\''REMOTE'\''\n%s\nREMOTE\n)"\n' "$out" "$flag" "$script"
  else
    "$@" "$flag$script"
  fi
}
step() { echo "# $*"; }

find_gin_file() {  # find_gin_file REPO FILE: print FILE as given, in REPO/jaxserve/configs/ (the package's presets), or in REPO, or die
  local repo="$1" gin_file="$2" candidate
  for candidate in "$gin_file" "$repo/jaxserve/configs/$gin_file" "$repo/jaxserve/$gin_file" "$repo/$gin_file"; do
    if [[ -f "$candidate" ]]; then gin_file="$candidate"; break; fi
  done
  [[ -f "$gin_file" ]] || die "--gin-file $gin_file not found"
  printf '%s\n' "$gin_file"
}

jax_version() {  # jax_version REPO: print the jax version pinned in REPO/requirements.lock, or die
  local version
  version="$(sed -n 's/^jax==\([0-9.]*\).*/\1/p' "$1/requirements.lock" | head -n1)"
  [[ -n "$version" ]] || die "cannot read the jax version from $1/requirements.lock"
  printf '%s\n' "$version"
}

# Set INSTALL_SCRIPT, CONFIG_SCRIPT, SERVICE_SCRIPT and HEALTH_SCRIPT: the scripts to run on the
# machine, in that order, from what differs between the launchers:
#   JAX_EXTRA     the jax extra to install: cuda12 or tpu
#   DEVICE_CHECK  a command that checks the accelerator before installing ("": none)
#   IMPORT_CHECK  Python run in the new venv after installing
#   WRITER        the start of deploy.gin's comment, e.g. "launch_gpu_vm.sh: the preset"
#   EXTRA_GIN     lines after the preset's include in deploy.gin ("": none)
# and the launch settings: VERSION (jax), CHECKPOINT ("": the preset's; gs://...: copied onto
# /models/), PORT, WAIT_TIMEOUT (seconds to wait for SERVING).
# shellcheck disable=SC2034  # the *_SCRIPT variables are for the launcher that sources this file
build_remote_scripts() {  # build_remote_scripts JAX_EXTRA DEVICE_CHECK IMPORT_CHECK WRITER EXTRA_GIN VERSION CHECKPOINT PORT WAIT_TIMEOUT
  local jax_extra="$1" device_check="$2" import_check="$3" writer="$4" extra_gin="$5"
  local version="$6" checkpoint="$7" port="$8" wait_timeout="$9"
  local venv=/opt/jaxserve/.venv model_line="" checkpoint_fetch="" health_py
  if [[ "$checkpoint" == gs://* ]]; then
    checkpoint_fetch="sudo mkdir -p /models && sudo chown \"\$(id -u):\$(id -g)\" /models && gcloud storage cp -r '$checkpoint' /models/"
    model_line="ServeConfig.model = '/models/$(basename "$checkpoint")'"
  elif [[ -n "$checkpoint" ]]; then
    model_line="ServeConfig.model = '$checkpoint'"
  fi

  INSTALL_SCRIPT="set -euo pipefail
${device_check:+$device_check
}sudo mkdir -p /opt/jaxserve /etc/jaxserve /var/cache/jaxserve
sudo chown \"\$(id -u):\$(id -g)\" /opt/jaxserve
tar -xzf /tmp/jaxserve-src.tar.gz -C /opt/jaxserve
# jaxserve needs Python >= 3.11; uv brings one on any image.
command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh
export PATH=\"\$HOME/.local/bin:\$PATH\"
uv venv --allow-existing --python 3.11 $venv
uv pip install --python $venv/bin/python 'jax[$jax_extra]==$version'
uv pip install --python $venv/bin/python -e /opt/jaxserve
$venv/bin/python -c '$import_check'"

  CONFIG_SCRIPT="set -euo pipefail
${checkpoint_fetch:+$checkpoint_fetch
}sudo install -m 0644 /tmp/jaxserve-model.gin /etc/jaxserve/model.gin
sudo tee /etc/jaxserve/deploy.gin >/dev/null <<'GIN'
# Written by $writer, with the checkpoint and port of this host.
include '/etc/jaxserve/model.gin'
${extra_gin:+$extra_gin
}${model_line:+$model_line
}ServeConfig.host = '0.0.0.0'
ServeConfig.port = $port
ServeConfig.compilation_cache_dir = '/var/cache/jaxserve/xla'
GIN
$venv/bin/python -c \"from jaxserve.serve_config import load_config; load_config(['/etc/jaxserve/deploy.gin'])\""

  SERVICE_SCRIPT="set -euo pipefail
sudo tee /etc/systemd/system/jaxserve.service >/dev/null <<'UNIT'
[Unit]
Description=jaxserve gRPC inference server
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
Environment=PYTHONUNBUFFERED=1
Environment=JAXSERVE_CACHE_DIR=/var/cache/jaxserve${SERVICE_ENV:+
$SERVICE_ENV}
ExecStart=$venv/bin/jaxserve serve --gin_file /etc/jaxserve/deploy.gin
Restart=on-failure
RestartSec=5
KillSignal=SIGTERM
TimeoutStopSec=90
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
UNIT
sudo systemctl daemon-reload
sudo systemctl enable jaxserve
sudo systemctl restart jaxserve"

  health_py="import grpc, sys
from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g
try:
    s = g.HealthStub(grpc.insecure_channel('127.0.0.1:$port')).Check(h.HealthCheckRequest(), timeout=5).status
except grpc.RpcError:
    sys.exit(1)
sys.exit(0 if s == h.HealthCheckResponse.SERVING else 1)"
  HEALTH_SCRIPT="set -euo pipefail
deadline=\$(( \$(date +%s) + $wait_timeout ))
until $venv/bin/python -c \"$health_py\"; do
  if (( \$(date +%s) > deadline )); then
    echo 'jaxserve did not report SERVING in time; last log lines:' >&2
    sudo journalctl -u jaxserve -n 50 --no-pager >&2
    exit 1
  fi
  sleep 10
done
echo SERVING"
}
