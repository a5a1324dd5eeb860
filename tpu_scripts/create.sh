#!/usr/bin/env bash
# Request a TPU slice as a queued resource (spot by default).
set -euo pipefail
source "$(dirname "$0")/common.sh"
usage() {
  cat <<HELP
usage: create.sh --name NAME --zone ZONE --project PROJECT [--accelerator-type TYPE]
                 [--runtime-version VERSION] [--on-demand] [--dry-run]

Requests a TPU VM slice through a queued resource: it is created when capacity is free.
  --accelerator-type TYPE    default v5litepod-16 (v5e, 4 hosts x 4 chips)
  --runtime-version VERSION  default v2-alpha-tpuv5-lite
  --on-demand                on-demand capacity instead of spot (spot can be preempted;
                             polyalign checkpoints on SIGTERM and resumes with the same command)
$COMMON_HELP
HELP
}
parse_common "$@"
TYPE=v5litepod-16
RUNTIME=v2-alpha-tpuv5-lite
SPOT=(--spot)
set -- "${REST[@]+"${REST[@]}"}"
while (($#)); do
  case "$1" in
    --accelerator-type) TYPE="$2"; shift 2 ;;
    --runtime-version) RUNTIME="$2"; shift 2 ;;
    --on-demand) SPOT=(); shift ;;
    *) die "unknown argument $1" ;;
  esac
done
run gcloud compute tpus queued-resources create "$NAME" --node-id="$NAME" $(where) \
  --accelerator-type="$TYPE" --runtime-version="$RUNTIME" "${SPOT[@]+"${SPOT[@]}"}"
