#!/usr/bin/env bash
# Run one polyalign command on every worker at once; one log file per worker.
set -euo pipefail
source "$(dirname "$0")/common.sh"
usage() {
  cat <<HELP
usage: launch.sh --name NAME --zone ZONE --project PROJECT --workers N [--log-dir DIR] [--dry-run]
                 -- polyalign COMMAND ...

Starts the command on workers 0..N-1 with POLYALIGN_NUM_PROCESSES=N (JAX finds its peers through
the TPU VM's metadata; a process that does not find all N stops with one line) and writes
DIR/worker-<i>.log (default DIR: logs/NAME). Waits for all; fails if any fails.
  --workers N     hosts in the slice (v5litepod-16: 4, v5p-8: 1)
Example:
  launch.sh --name demo --zone us-west4-a --project P --workers 4 -- \\
      polyalign train sft --config configs/sft_demo.yaml --out gs://BUCKET/runs/sft data.dir=gs://BUCKET/runs/demo
$COMMON_HELP
HELP
}
parse_common "$@"
WORKERS=""
LOG_DIR=""
COMMAND=()
set -- "${REST[@]+"${REST[@]}"}"
while (($#)); do
  case "$1" in
    --workers) WORKERS="$2"; shift 2 ;;
    --log-dir) LOG_DIR="$2"; shift 2 ;;
    --) shift; COMMAND=("$@"); break ;;
    *) die "unknown argument $1 (put the command after --)" ;;
  esac
done
[[ -n "$WORKERS" ]] || die "--workers is required"
((${#COMMAND[@]})) || die "give the command after --"
# The remote shell splits the command again: every argument goes quoted, so a path with a space or a
# `;` arrives as one argument and runs nothing. Only the program's ~ is left for the remote to expand.
PROGRAM="$(printf '%q' "${COMMAND[0]}")"
[[ "${COMMAND[0]}" == polyalign ]] && PROGRAM="~/venv/bin/polyalign"
LOG_DIR="${LOG_DIR:-logs/$NAME}"
REMOTE="cd ~/polyalign && POLYALIGN_NUM_PROCESSES=$(printf '%q' "$WORKERS") $PROGRAM$(printf ' %q' "${COMMAND[@]:1}")"
run mkdir -p "$LOG_DIR"
pids=()
for ((i = 0; i < WORKERS; i++)); do
  if ((DRY_RUN)); then
    echo "$(run gcloud compute tpus tpu-vm ssh "$NAME" --worker="$i" $(where) --command "$REMOTE") > $LOG_DIR/worker-$i.log 2>&1 &"
  else
    gcloud compute tpus tpu-vm ssh "$NAME" --worker="$i" $(where) --command "$REMOTE" > "$LOG_DIR/worker-$i.log" 2>&1 &
    pids+=($!)
  fi
done
status=0
for pid in "${pids[@]+"${pids[@]}"}"; do wait "$pid" || status=$?; done
exit $status
