#!/usr/bin/env bash
# Launch jaxserve on a GPU machine: a new Compute Engine VM with NVIDIA GPUs, or any host you
# can reach over SSH (--host user@addr).
#
# Steps: create the VM (skipped with --host), install jax[cuda12] and jaxserve, copy the gin config
# (with the checkpoint path and port) to /etc/jaxserve, install and start a systemd service running
# `jaxserve serve --gin_file /etc/jaxserve/deploy.gin`, wait until gRPC health says SERVING, print
# the endpoint. --dry-run prints every command instead.
#
#   scripts/launch_gpu_vm.sh --name qwen7b --zone us-central1-a --gpu-type nvidia-l4 \
#       --machine-type g2-standard-16 --gin-file jaxserve/configs/qwen2.5-7b-instruct.gin
#   scripts/launch_gpu_vm.sh --host ubuntu@10.0.0.5 --gin-file jaxserve/configs/llama-3.1-8b-instruct.gin \
#       --checkpoint /data/Llama-3.1-8B-Instruct
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

usage() {
  cat <<'EOF'
usage: scripts/launch_gpu_vm.sh (--name NAME --zone ZONE | --host USER@ADDR) [options]

Serve a gin-configured model with systemd on a new GCE GPU VM or on an existing SSH host.

  --name NAME               VM name (gcloud mode; required without --host)
  --zone ZONE               zone, e.g. us-central1-a (gcloud mode)
  --project PROJECT         GCP project (default: gcloud's configured project)
  --gpu-type TYPE           GPU accelerator type (default: nvidia-h100-80gb)
  --gpu-count N             GPUs (default: 1; match the config's tensor_parallel_size)
  --machine-type TYPE       (default: a3-highgpu-1g)
  --image-family FAMILY     boot image with the NVIDIA driver (default: common-cu124-debian-11-py310)
  --image-project PROJECT   (default: deeplearning-platform-release)
  --host USER@ADDR          use this SSH-reachable host instead of creating a VM (driver installed)
  --gin-file FILE           model preset, e.g. jaxserve/configs/qwen2.5-7b-instruct.gin
                            (default: jaxserve/configs/llama-3.1-8b-instruct.gin)
  --checkpoint PATH         checkpoint directory on the machine, or gs://... to copy onto /models/
                            (default: the preset's ServeConfig.model)
  --port PORT               gRPC port (default: 50051)
  --existing                the VM exists: skip creation (gcloud mode)
  --wait-timeout SECONDS    how long to wait for SERVING (default: 1800)
  --dry-run                 print every command (prefixed "+ ") instead of running it
  -h, --help                this help
EOF
}

die() { echo "launch_gpu_vm.sh: error: $*" >&2; exit 2; }

NAME="" ZONE="" PROJECT="" GPU_TYPE="nvidia-h100-80gb" GPU_COUNT=1 MACHINE_TYPE="a3-highgpu-1g"
IMAGE_FAMILY="common-cu124-debian-11-py310" IMAGE_PROJECT="deeplearning-platform-release" HOST=""
GIN_FILE="jaxserve/configs/llama-3.1-8b-instruct.gin" CHECKPOINT="" PORT=50051 EXISTING=0 WAIT_TIMEOUT=1800 DRY_RUN=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) NAME="${2:?--name needs a value}"; shift 2 ;;
    --zone) ZONE="${2:?--zone needs a value}"; shift 2 ;;
    --project) PROJECT="${2:?--project needs a value}"; shift 2 ;;
    --gpu-type) GPU_TYPE="${2:?--gpu-type needs a value}"; shift 2 ;;
    --gpu-count) GPU_COUNT="${2:?--gpu-count needs a value}"; shift 2 ;;
    --machine-type) MACHINE_TYPE="${2:?--machine-type needs a value}"; shift 2 ;;
    --image-family) IMAGE_FAMILY="${2:?--image-family needs a value}"; shift 2 ;;
    --image-project) IMAGE_PROJECT="${2:?--image-project needs a value}"; shift 2 ;;
    --host) HOST="${2:?--host needs a value}"; shift 2 ;;
    --gin-file) GIN_FILE="${2:?--gin-file needs a value}"; shift 2 ;;
    --checkpoint) CHECKPOINT="${2:?--checkpoint needs a value}"; shift 2 ;;
    --port) PORT="${2:?--port needs a value}"; shift 2 ;;
    --existing) EXISTING=1; shift ;;
    --wait-timeout) WAIT_TIMEOUT="${2:?--wait-timeout needs a value}"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done

if [[ -n "$HOST" ]]; then
  [[ "$HOST" == *@* ]] || die "--host must be USER@ADDR, got $HOST"
  [[ -z "$NAME" ]] || die "--host and --name are exclusive"
else
  [[ -n "$NAME" ]] || die "--name (gcloud) or --host USER@ADDR is required"
  [[ -n "$ZONE" ]] || die "--zone is required with --name"
fi
if ! [[ "$PORT" =~ ^[0-9]+$ ]] || (( PORT < 1 || PORT > 65535 )); then die "--port must be 1-65535, got $PORT"; fi
[[ "$GPU_COUNT" =~ ^[1-9][0-9]*$ ]] || die "--gpu-count must be a positive integer"
[[ "$WAIT_TIMEOUT" =~ ^[0-9]+$ ]] || die "--wait-timeout must be a number of seconds"

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GIN_FILE="$(find_gin_file "$REPO" "$GIN_FILE")"  # as given, in jaxserve/configs/, in the repo
JAX_VERSION="$(jax_version "$REPO")"

GCLOUD_SCOPE=()
if [[ -z "$HOST" ]]; then
  GCLOUD_SCOPE=(--zone="$ZONE")
  if [[ -n "$PROJECT" ]]; then GCLOUD_SCOPE+=(--project="$PROJECT"); fi
fi
TARBALL="${TMPDIR:-/tmp}/jaxserve-src-${NAME:-${HOST#*@}}.tar.gz"
SSH_OPTS=(-o StrictHostKeyChecking=accept-new -o ServerAliveInterval=30)

remote() {  # remote SCRIPT: run a script on the machine
  if [[ -n "$HOST" ]]; then
    run_remote "" "$1" ssh "${SSH_OPTS[@]}" "$HOST"
  else
    run_remote --command= "$1" gcloud compute ssh "$NAME" "${GCLOUD_SCOPE[@]}"
  fi
}
copy() {  # copy LOCAL REMOTE_PATH
  if [[ -n "$HOST" ]]; then
    run scp "${SSH_OPTS[@]}" "$1" "$HOST:$2"
  else
    run gcloud compute scp "$1" "$NAME:$2" "${GCLOUD_SCOPE[@]}"
  fi
}

build_remote_scripts cuda12 "nvidia-smi --query-gpu=name,memory.total --format=csv" \
  "import jax; print(jax.devices())" "launch_gpu_vm.sh: the preset" "" \
  "$JAX_VERSION" "$CHECKPOINT" "$PORT" "$WAIT_TIMEOUT"

if [[ -n "$HOST" ]]; then
  echo "# jaxserve on $HOST over SSH; config $(basename "$GIN_FILE")"
else
  echo "# jaxserve on GCE VM $NAME ($MACHINE_TYPE, ${GPU_COUNT}x $GPU_TYPE) in $ZONE; config $(basename "$GIN_FILE")"
fi

step "1/6 create the VM"
if [[ -n "$HOST" ]]; then
  echo "# --host: using $HOST as it is (NVIDIA driver expected)"
elif (( EXISTING )); then
  echo "# --existing: using VM $NAME as it is"
else
  run gcloud compute instances create "$NAME" "${GCLOUD_SCOPE[@]}" --machine-type="$MACHINE_TYPE" \
    --accelerator="type=$GPU_TYPE,count=$GPU_COUNT" --maintenance-policy=TERMINATE \
    --image-family="$IMAGE_FAMILY" --image-project="$IMAGE_PROJECT" --boot-disk-size=500GB \
    --metadata=install-nvidia-driver=True
fi

step "2/6 install jax[cuda12]==$JAX_VERSION and jaxserve"
run git -C "$REPO" archive --format=tar.gz -o "$TARBALL" HEAD
copy "$TARBALL" /tmp/jaxserve-src.tar.gz
remote "$INSTALL_SCRIPT"

step "3/6 copy the gin config and set the checkpoint path"
copy "$GIN_FILE" /tmp/jaxserve-model.gin
remote "$CONFIG_SCRIPT"

step "4/6 install and start the systemd service"
remote "$SERVICE_SCRIPT"

step "5/6 wait until gRPC health says SERVING"
remote "$HEALTH_SCRIPT"

step "6/6 endpoint"
if [[ -n "$HOST" ]]; then
  IP="${HOST#*@}"
elif (( DRY_RUN )); then
  run gcloud compute instances describe "$NAME" "${GCLOUD_SCOPE[@]}" \
    --format='get(networkInterfaces[0].accessConfigs[0].natIP)'
  IP="EXTERNAL_IP"
else
  IP="$(gcloud compute instances describe "$NAME" "${GCLOUD_SCOPE[@]}" \
    --format='get(networkInterfaces[0].accessConfigs[0].natIP)')"
fi
echo "endpoint: $IP:$PORT"
echo "# try: jaxserve client --target $IP:$PORT 'def fibonacci(n):'  (the port must be open in the firewall)"
