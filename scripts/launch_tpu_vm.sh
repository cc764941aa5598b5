#!/usr/bin/env bash
# Launch jaxserve on a Cloud TPU VM (single host or a multi-host slice).
#
# Steps: create the TPU VM, install jax[tpu] and jaxserve on every worker, copy the gin config
# (with the checkpoint path and port) to /etc/jaxserve, install and start a systemd service
# running `jaxserve serve --gin_file /etc/jaxserve/deploy.gin` on every worker, wait until gRPC
# health on worker 0 says SERVING, print the endpoint. --dry-run prints every command instead.
#
#   scripts/launch_tpu_vm.sh --name llama8b --zone us-east5-b --accelerator-type v6e-1 \
#       --gin-file jaxserve/configs/llama-3.1-8b-instruct.gin --checkpoint gs://my-bucket/Llama-3.1-8B-Instruct
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

usage() {
  cat <<'EOF'
usage: scripts/launch_tpu_vm.sh --name NAME --zone ZONE [options]

Create a Cloud TPU VM and serve a gin-configured model on it with systemd.

  --name NAME               TPU VM name (required)
  --zone ZONE               zone, e.g. us-east5-b (required)
  --project PROJECT         GCP project (default: gcloud's configured project)
  --accelerator-type TYPE   e.g. v6e-1, v5litepod-8, v5litepod-16 (multi-host), v4-8 (default: v5litepod-8)
  --runtime-version VER     TPU VM software version (default: v2-alpha-tpuv5-lite; v2-alpha-tpuv6e for v6e,
                            tpu-ubuntu2204-base for v4/v5p)
  --gin-file FILE           model preset, e.g. jaxserve/configs/llama-3.1-8b-instruct.gin (default: that one);
                            base/tpu.gin is applied after it
  --checkpoint PATH         checkpoint directory on the VM, or gs://... to copy onto /models/ (default: the
                            preset's ServeConfig.model)
  --port PORT               gRPC port (default: 50051)
  --spot                    create a Spot TPU VM
  --existing                the VM exists: skip creation
  --wait-timeout SECONDS    how long to wait for SERVING (default: 1800; warm-up compiles every bucket)
  --dry-run                 print every command (prefixed "+ ") instead of running it
  -h, --help                this help

Multi-host slices (e.g. v5litepod-16, v4-16): jax runs one process per worker, so installation and
the service run on every worker (--worker=all); the endpoint is worker 0.
EOF
}

die() { echo "launch_tpu_vm.sh: error: $*" >&2; exit 2; }

NAME="" ZONE="" PROJECT="" ACCEL="v5litepod-8" RUNTIME="" GIN_FILE="jaxserve/configs/llama-3.1-8b-instruct.gin"
CHECKPOINT="" PORT=50051 SPOT=0 EXISTING=0 WAIT_TIMEOUT=1800 DRY_RUN=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) NAME="${2:?--name needs a value}"; shift 2 ;;
    --zone) ZONE="${2:?--zone needs a value}"; shift 2 ;;
    --project) PROJECT="${2:?--project needs a value}"; shift 2 ;;
    --accelerator-type) ACCEL="${2:?--accelerator-type needs a value}"; shift 2 ;;
    --runtime-version) RUNTIME="${2:?--runtime-version needs a value}"; shift 2 ;;
    --gin-file) GIN_FILE="${2:?--gin-file needs a value}"; shift 2 ;;
    --checkpoint) CHECKPOINT="${2:?--checkpoint needs a value}"; shift 2 ;;
    --port) PORT="${2:?--port needs a value}"; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --existing) EXISTING=1; shift ;;
    --wait-timeout) WAIT_TIMEOUT="${2:?--wait-timeout needs a value}"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done

[[ -n "$NAME" ]] || die "--name is required"
[[ -n "$ZONE" ]] || die "--zone is required"
if ! [[ "$PORT" =~ ^[0-9]+$ ]] || (( PORT < 1 || PORT > 65535 )); then die "--port must be 1-65535, got $PORT"; fi
[[ "$WAIT_TIMEOUT" =~ ^[0-9]+$ ]] || die "--wait-timeout must be a number of seconds"

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GIN_FILE="$(find_gin_file "$REPO" "$GIN_FILE")"  # as given, in jaxserve/configs/, in the repo

if [[ -z "$RUNTIME" ]]; then
  case "$ACCEL" in
    v6e-*) RUNTIME="v2-alpha-tpuv6e" ;;
    v5litepod-*|v5e-*) RUNTIME="v2-alpha-tpuv5-lite" ;;
    *) RUNTIME="tpu-ubuntu2204-base" ;;
  esac
fi

# Hosts in the slice: v2/v3/v4/v5p count TensorCores (8 per host up to a full host; v4/v5p have
# 2 cores per chip, 4 chips per host); v5e/v6e count chips (up to 8 on one host, 4 per host above).
tpu_hosts() {
  local n="${1##*-}"
  [[ "$n" =~ ^[0-9]+$ ]] || { echo 1; return; }
  case "$1" in
    v5litepod-*|v5e-*|v6e-*) if (( n <= 8 )); then echo 1; else echo $(( n / 4 )); fi ;;
    *) if (( n <= 8 )); then echo 1; else echo $(( n / 8 )); fi ;;
  esac
}
HOSTS="$(tpu_hosts "$ACCEL")"
# A multi-host slice is one jax.distributed job: JAX finds the workers itself ("auto"); worker 0
# serves, the others replay its steps (jaxserve/multihost.py).
SERVICE_ENV=""
if (( HOSTS > 1 )); then SERVICE_ENV="Environment=JAXSERVE_COORDINATOR=auto"; fi

JAX_VERSION="$(jax_version "$REPO")"

GCLOUD_SCOPE=(--zone="$ZONE")
if [[ -n "$PROJECT" ]]; then GCLOUD_SCOPE+=(--project="$PROJECT"); fi
TARBALL="${TMPDIR:-/tmp}/jaxserve-src-$NAME.tar.gz"

tpu_ssh() {  # tpu_ssh WORKER SCRIPT
  run_remote --command= "$2" gcloud compute tpus tpu-vm ssh "$NAME" "${GCLOUD_SCOPE[@]}" --worker="$1"
}

build_remote_scripts tpu "" "import jax, jaxserve.serve_config; print(jax.__version__)" \
  "launch_tpu_vm.sh: the preset, retargeted to TPU" "include 'base/tpu.gin'" \
  "$JAX_VERSION" "$CHECKPOINT" "$PORT" "$WAIT_TIMEOUT"

echo "# jaxserve on TPU VM $NAME ($ACCEL, $HOSTS host(s), runtime $RUNTIME) in $ZONE; config $(basename "$GIN_FILE")"
if (( HOSTS > 1 )); then
  echo "# multi-host slice: every command below with --worker=all runs on all $HOSTS workers"
fi

step "1/6 create the TPU VM"
if (( EXISTING )); then
  echo "# --existing: using TPU VM $NAME as it is"
else
  CREATE=(gcloud compute tpus tpu-vm create "$NAME" "${GCLOUD_SCOPE[@]}" --accelerator-type="$ACCEL"
          --version="$RUNTIME")
  if (( SPOT )); then CREATE+=(--spot); fi
  run "${CREATE[@]}"
fi

step "2/6 install jax[tpu]==$JAX_VERSION and jaxserve on every worker"
run git -C "$REPO" archive --format=tar.gz -o "$TARBALL" HEAD
run gcloud compute tpus tpu-vm scp "$TARBALL" "$NAME:/tmp/jaxserve-src.tar.gz" "${GCLOUD_SCOPE[@]}" --worker=all
tpu_ssh all "$INSTALL_SCRIPT"

step "3/6 copy the gin config and set the checkpoint path"
run gcloud compute tpus tpu-vm scp "$GIN_FILE" "$NAME:/tmp/jaxserve-model.gin" "${GCLOUD_SCOPE[@]}" --worker=all
tpu_ssh all "$CONFIG_SCRIPT"

step "4/6 install and start the systemd service (the same command on every worker)"
tpu_ssh all "$SERVICE_SCRIPT"

step "5/6 wait until gRPC health on worker 0 says SERVING"
tpu_ssh 0 "$HEALTH_SCRIPT"

step "6/6 endpoint"
if (( DRY_RUN )); then
  run gcloud compute tpus tpu-vm describe "$NAME" "${GCLOUD_SCOPE[@]}" \
    --format='value(networkEndpoints[0].accessConfig.externalIp)'
  IP="EXTERNAL_IP"
else
  IP="$(gcloud compute tpus tpu-vm describe "$NAME" "${GCLOUD_SCOPE[@]}" \
    --format='value(networkEndpoints[0].accessConfig.externalIp)')"
fi
echo "endpoint: $IP:$PORT"
echo "# try: jaxserve client --target $IP:$PORT 'def fibonacci(n):'  (open tcp:$PORT in the VPC firewall first)"
