#!/usr/bin/env bash
# Here, with a package index: the wheels of packages the accelerator machine lacks, for its Python (3.12,
# x86-64 Linux), into .whl/, which bench/device_run.sh installs there without their dependencies. Name each
# missing package and version (device_run's backend stage names what polyalign's trainer misses), e.g.
#   bash bench/device_wheels.sh tensorboardX==2.6.4
# then pass .whl in the device call's carry. .whl/ stays out of git (.git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: bash bench/device_wheels.sh NAME==VERSION [...]" >&2; exit 2; }
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${DEVICE_PYTHON:-3.12}" \
  --implementation cp "${platforms[@]}" -d .whl "$@"
ls -la .whl
