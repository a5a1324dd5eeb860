#!/usr/bin/env bash
# The last lines of every worker's log written by launch.sh (or follow them).
set -euo pipefail
source "$(dirname "$0")/common.sh"
usage() {
  cat <<HELP
usage: logs.sh --name NAME --zone ZONE --project PROJECT [--log-dir DIR] [--lines N] [--follow] [--dry-run]
$COMMON_HELP
HELP
}
parse_common "$@"
LOG_DIR=""
LINES=40
FOLLOW=()
set -- "${REST[@]+"${REST[@]}"}"
while (($#)); do
  case "$1" in
    --log-dir) LOG_DIR="$2"; shift 2 ;;
    --lines) LINES="$2"; shift 2 ;;
    --follow) FOLLOW=(-f); shift ;;
    *) die "unknown argument $1" ;;
  esac
done
LOG_DIR="${LOG_DIR:-logs/$NAME}"
if ((DRY_RUN)); then
  echo "tail -n $LINES ${FOLLOW[*]+"${FOLLOW[*]} "}$LOG_DIR/worker-*.log"
else
  tail -n "$LINES" "${FOLLOW[@]+"${FOLLOW[@]}"}" "$LOG_DIR"/worker-*.log
fi
