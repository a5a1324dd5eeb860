#!/usr/bin/env bash
# Here, with a package index: the wheels of packages the accelerator machine lacks, for its Python (3.12,
# x86-64 Linux; DEVICE_PYTHON for another), into .whl/, which bench/device_run.sh installs there without
# their dependencies. Name each package and version (device_run's backend stage names what polyalign's
# trainer misses), or --tunix for Tunix's DPO peer:
#   bash bench/device_wheels.sh --tunix
#   bash bench/device_wheels.sh tensorboardX==2.6.5
# then name .whl in the device call's carry. Each call replaces .whl/ (name every package in one call: two
# versions of one package there would stop the install); .whl/ stays out of git (its info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
# What Tunix 0.1.7's DPO trainer and Qwen2 model import beyond the machine image's packages (jax, flax,
# optax, orbax, jaxtyping, wrapt, ...), found by importing them with only those installed. Carry no package
# the image has: a carried wheel comes before the image's own on the path.
TUNIX=(google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12 tensorboardX==2.6.5 perfetto==0.59.1)
wanted=()
for arg in "$@"; do
  if [ "$arg" = "--tunix" ]; then wanted+=("${TUNIX[@]}"); else wanted+=("$arg"); fi
done
[ ${#wanted[@]} -gt 0 ] || { echo "usage: bash bench/device_wheels.sh [--tunix] [NAME==VERSION ...]" >&2; exit 2; }
exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree or submodule
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${DEVICE_PYTHON:-3.12}" \
  --implementation cp "${platforms[@]}" -d .whl "${wanted[@]}"
ls -l .whl
