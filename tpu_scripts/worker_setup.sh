#!/usr/bin/env bash
# Runs on each TPU worker (setup.sh starts it there): a Python >= 3.12 in ~/venv, polyalign[tpu] in it,
# then the resolved jax, jaxlib and libtpu. The TPU runtimes' Ubuntu 22.04 images ship python3 3.10,
# which polyalign (>= 3.11) and jax >= 0.11 (>= 3.12) cannot use, so the interpreter comes from uv
# (a standalone CPython build) unless POLYALIGN_PYTHON names one already on the worker.
#   worker_setup.sh [--check-only] [--checkout DIR] [--venv DIR]
set -euo pipefail
CHECKOUT="$HOME/polyalign"
VENV="$HOME/venv"
CHECK_ONLY=0
WANT=3.12
while (($#)); do
  case "$1" in
    --check-only) CHECK_ONLY=1; shift ;;
    --checkout) CHECKOUT="$2"; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    *) echo "worker_setup.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
host="$(hostname)"
die() { echo "worker_setup.sh on $host: error: $*" >&2; exit 2; }

if [[ -n "${POLYALIGN_PYTHON:-}" ]]; then
  PY="$POLYALIGN_PYTHON"
  command -v "$PY" >/dev/null 2>&1 || die "POLYALIGN_PYTHON=$PY: no such program"
else
  if ! command -v uv >/dev/null 2>&1 && [[ ! -x "$HOME/.local/bin/uv" ]]; then
    ((CHECK_ONLY)) && die "no uv on this worker and --check-only: nothing installed"
    curl -LsSf https://astral.sh/uv/install.sh | sh >/dev/null || die "installing uv failed (no network?)"
  fi
  UV="$(command -v uv || echo "$HOME/.local/bin/uv")"
  "$UV" python install "$WANT" >/dev/null || die "uv could not install Python $WANT"
  PY="$("$UV" python find "$WANT")"
fi
version="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" \
  || die "$PY does not run"
major="${version%%.*}"; minor="${version#*.}"
if ((major < 3 || (major == 3 && minor < 11))); then
  die "$PY is Python $version; polyalign needs >= 3.11 (and jax >= 0.11 needs >= 3.12): set POLYALIGN_PYTHON to a newer one, or unset it to let uv fetch $WANT"
fi
echo "worker $host: Python $version ($PY)"
((CHECK_ONLY)) && exit 0
[[ -f "$CHECKOUT/pyproject.toml" ]] || die "$CHECKOUT holds no polyalign checkout"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q -e "$CHECKOUT[tpu]"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
import socket

def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "absent"

print(f"worker {socket.gethostname()}: jax {version('jax')}, jaxlib {version('jaxlib')}, libtpu {version('libtpu')}, "
      f"polyalign {version('polyalign')}")
PY
