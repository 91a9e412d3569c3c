#!/usr/bin/env bash
# Cloud TPU VM lifecycle for m2r2_jax: create, install, run one command on every worker, follow
# logs, delete. Every step is a gcloud command; DRY_RUN=1 prints them instead of running them.
#
#   launch/tpu_vm.sh create                       # TPU_NAME, ZONE, ACCELERATOR, VERSION, PROJECT from env
#   launch/tpu_vm.sh install                      # copy this checkout to all workers, pip install .[tpu]
#   launch/tpu_vm.sh run 'm2r2 distill --config=configs/m2r2/llama3_8b.py --mesh fsdp=-1 ...'
#   launch/tpu_vm.sh logs                         # follow the run's log on worker 0
#   launch/tpu_vm.sh delete
#
# `run` starts the same command on all workers in the background (nohup, log in ~/m2r2_run.log):
# jax.distributed.initialize() finds the other workers by itself on TPU VMs, so the command is the
# one you would run on a single host, plus --mesh for the pod.
set -euo pipefail

TPU_NAME=${TPU_NAME:-m2r2}
ZONE=${ZONE:-us-central2-b}
ACCELERATOR=${ACCELERATOR:-v4-32}
VERSION=${VERSION:-tpu-ubuntu2204-base}
PROJECT=${PROJECT:-}
REMOTE_DIR=${REMOTE_DIR:-m2r2_jax}
LOG=${LOG:-m2r2_run.log}

die() { echo "tpu_vm.sh: error: $*" >&2; exit 2; }

gcloud_tpu() {
  local args=(gcloud compute tpus tpu-vm "$@" --zone="$ZONE")
  [[ -n "$PROJECT" ]] && args+=(--project="$PROJECT")
  if [[ "${DRY_RUN:-0}" == 1 ]]; then printf '%q ' "${args[@]}"; echo; else "${args[@]}"; fi
}

on_all() { gcloud_tpu ssh "$TPU_NAME" --worker=all --command="$1"; }

cmd=${1:-}
case "$cmd" in
  create)
    gcloud_tpu create "$TPU_NAME" --accelerator-type="$ACCELERATOR" --version="$VERSION" ;;
  install)
    root=$(cd "$(dirname "$0")/.." && pwd)
    gcloud_tpu scp --recurse "$root" "$TPU_NAME:~/$REMOTE_DIR" --worker=all
    on_all "cd ~/$REMOTE_DIR && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]'" ;;
  run)
    [[ $# -ge 2 ]] || die "run needs the command to run, e.g. run 'm2r2 distill ...'"
    quoted=$(printf '%q' "$2")
    on_all "cd ~/$REMOTE_DIR && source .venv/bin/activate && nohup bash -c $quoted > ~/$LOG 2>&1 < /dev/null &"
    echo "started on all workers of $TPU_NAME; follow with: $0 logs" ;;
  logs)
    gcloud_tpu ssh "$TPU_NAME" --worker=0 --command="tail -n 100 -F ~/$LOG" ;;
  delete)
    gcloud_tpu delete "$TPU_NAME" --quiet ;;
  *)
    die "unknown step '${cmd}'; expected create, install, run, logs or delete" ;;
esac
