#!/usr/bin/env bash
# Copy this checkout to every worker and install polyalign[tpu] under a Python >= 3.12 (worker_setup.sh).
set -euo pipefail
source "$(dirname "$0")/common.sh"
usage() {
  cat <<HELP
usage: setup.sh --name NAME --zone ZONE --project PROJECT [--dry-run]

Packs the committed checkout (git archive HEAD), copies it to all workers, and runs
tpu_scripts/worker_setup.sh on each: a Python 3.12 from uv (the runtime images' python3 is 3.10; set
POLYALIGN_PYTHON on the workers to use another >= 3.11), checked before anything is installed, then
~/venv with pip install -e '~/polyalign[tpu]'; each worker prints its jax, jaxlib and libtpu.
$COMMON_HELP
HELP
}
parse_common "$@"
((${#REST[@]} == 0)) || die "unknown argument ${REST[0]}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
if ((DRY_RUN)); then
  ARCHIVE="${TMPDIR:-/tmp}/polyalign-$NAME.XXXXXX.tar.gz"
else
  # a fresh file only this user can write, removed on exit: never a fixed, guessable path in /tmp
  ARCHIVE="$(mktemp --suffix=.tar.gz "${TMPDIR:-/tmp}/polyalign-$NAME.XXXXXX")"
  trap 'rm -f "$ARCHIVE"' EXIT
fi
run git -C "$REPO" archive --format=tar.gz -o "$ARCHIVE" HEAD
run gcloud compute tpus tpu-vm scp "$ARCHIVE" "$NAME:~/polyalign.tar.gz" --worker=all $(where)
run gcloud compute tpus tpu-vm ssh "$NAME" --worker=all $(where) --command \
  "mkdir -p ~/polyalign && tar -xzf ~/polyalign.tar.gz -C ~/polyalign && bash ~/polyalign/tpu_scripts/worker_setup.sh"
