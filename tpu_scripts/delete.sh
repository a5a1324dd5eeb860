#!/usr/bin/env bash
# Delete the slice and its queued resource (stop the job first to keep its last steps).
set -euo pipefail
source "$(dirname "$0")/common.sh"
usage() {
  cat <<HELP
usage: delete.sh --name NAME --zone ZONE --project PROJECT [--dry-run]
$COMMON_HELP
HELP
}
parse_common "$@"
((${#REST[@]} == 0)) || die "unknown argument ${REST[0]}"
run gcloud compute tpus queued-resources delete "$NAME" $(where) --force --quiet
