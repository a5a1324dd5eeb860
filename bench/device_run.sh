#!/usr/bin/env bash
# One call on a fresh accelerator machine: polyalign runs from this checkout on the machine's own packages
# (its CUDA jax, flax, optax, orbax, torch, transformers), installing nothing from an index, which such a
# machine may not reach; pip would also replace its CUDA jax to meet a newer flax. Wheels carried in .whl/
# (bench/device_wheels.sh makes them here) go into a folder of their own, without their dependencies.
#   OUT=runs/device bash bench/device_run.sh [--budget SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  site="${TMPDIR:-/tmp}/polyalign-wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:$site"
  echo "device_run.sh: carried $(ls .whl | tr '\n' ' ')"
fi
exec python3 bench/device_run.py "$@"
