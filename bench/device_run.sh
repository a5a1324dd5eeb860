#!/usr/bin/env bash
# One call on a fresh accelerator machine: install polyalign against the machine's own jax (its CUDA
# build stays: the installed jax, jaxlib and CUDA plugin are pinned as constraints, so a newer flax
# cannot pull another jax in), then run bench/device_run.py with the arguments given.
#   OUT=runs/device bash bench/device_run.sh [--budget SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
constraints=$(mktemp)
python3 -m pip freeze | grep -iE '^(jax|jaxlib|jax[-_]cuda[0-9]*[-_](plugin|pjrt)|nvidia-[a-z0-9-]+)==' > "$constraints" || true
echo "device_run.sh: keeping $(tr '\n' ' ' < "$constraints")"
python3 -m pip install -q -e . -c "$constraints"
exec python3 bench/device_run.py "$@"
