#!/usr/bin/env bash
# One call on a fresh accelerator machine: polyalign runs from this checkout on the machine's own packages
# (its CUDA jax, flax, optax, orbax, torch, transformers), installing nothing from an index, which such a
# machine may not reach; pip would also replace its CUDA jax to meet a newer flax. Wheels carried in .whl/
# (bench/device_wheels.sh makes them here) go into a folder of their own, without their dependencies.
#   bash bench/device_run.sh --budget 500 --out /tmp/device --bundle "$OUT"
# (--bundle: summary.md and one archive of every row and log, for a machine that hands back few files)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  site="${TMPDIR:-/tmp}/polyalign-wheels"
  # a failed install is said and the run goes on: the backend stage names what the stages then miss
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      .whl/*.whl; then
    export PYTHONPATH="$PYTHONPATH:$site"
    echo "device_run.sh: carried $(ls .whl | tr '\n' ' ')"
  else
    echo "device_run.sh: the wheels in .whl/ did not install (above); going on without them" >&2
  fi
fi
exec python3 bench/device_run.py "$@"
