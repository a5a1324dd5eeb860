#!/usr/bin/env bash
# Ask a running job to stop cleanly (SIGTERM: polyalign saves a checkpoint and exits 0).
set -euo pipefail
source "$(dirname "$0")/common.sh"
usage() {
  cat <<HELP
usage: stop.sh --name NAME --zone ZONE --project PROJECT [--dry-run]

Sends SIGTERM to polyalign on every worker; each saves a checkpoint after its current step. Running
the same launch command again resumes from it.
$COMMON_HELP
HELP
}
parse_common "$@"
((${#REST[@]} == 0)) || die "unknown argument ${REST[0]}"
run gcloud compute tpus tpu-vm ssh "$NAME" --worker=all $(where) --command "pkill -TERM -f 'polyalign (train|generate)' || true"
