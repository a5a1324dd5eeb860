#!/usr/bin/env bash
# The queued resource's state and the TPU VM's health.
set -euo pipefail
source "$(dirname "$0")/common.sh"
usage() {
  cat <<HELP
usage: status.sh --name NAME --zone ZONE --project PROJECT [--dry-run]
$COMMON_HELP
HELP
}
parse_common "$@"
((${#REST[@]} == 0)) || die "unknown argument ${REST[0]}"
run gcloud compute tpus queued-resources describe "$NAME" $(where) --format="value(state.state)"
run gcloud compute tpus tpu-vm describe "$NAME" $(where) --format="value(state,health)"
