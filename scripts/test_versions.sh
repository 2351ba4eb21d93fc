#!/usr/bin/env bash
# Runs the test suite on another version set than the pinned one: `oldest` (the lower bounds pyproject declares, on
# the oldest Python it declares) or `newest` (the newest torch). Each set gets a venv of its own (.venv-SET); about
# 3 GB of CUDA-build wheels are downloaded the first time, since no CPU build of these torch releases is on PyPI.
#   bash scripts/test_versions.sh oldest|newest [pytest args]
set -euo pipefail
SET="${1:?usage: scripts/test_versions.sh oldest|newest [pytest args]}"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PINS="requirements/$SET.txt"
[ -f "$PINS" ] || { echo "no version set $SET ($PINS)" >&2; exit 2; }
# The first line of the pins file that names a Python, e.g. `# python: 3.10`; else the default python3.
WANT_PYTHON="$(sed -n 's/^# python: *//p' "$PINS" | head -n 1)"
PYTHON="${PYTHON:-python3}"
if [ -n "$WANT_PYTHON" ]; then
  PYTHON=""
  # On PATH, or installed by pyenv but not activated (its shim then refuses to run).
  for candidate in "python$WANT_PYTHON" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$WANT_PYTHON".*/bin/python; do
    if "$candidate" -c "" >/dev/null 2>&1; then
      PYTHON="$candidate"
      break
    fi
  done
  [ -n "$PYTHON" ] || { echo "$SET needs Python $WANT_PYTHON, which is not installed" >&2; exit 2; }
fi
VENV=".venv-$SET"
VERSION_OF='import sys; print("%d.%d" % sys.version_info[:2])'
if [ -x "$VENV/bin/python" ] && [ "$("$VENV/bin/python" -c "$VERSION_OF")" != "$("$PYTHON" -c "$VERSION_OF")" ]; then
  rm -rf "$VENV"  # made with another Python
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.ddpopt-installed"
WANT="$(cat "$PINS" pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "ddpopt: installing the $SET version set into $VENV"
  # A machine-wide pip constraint may cap torch below the set's release: this set's own pins decide here.
  export PIP_CONSTRAINT=/dev/null
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet "$(grep '^torch==' "$PINS")"
  "$VENV/bin/python" -m pip install --quiet -c "$PINS" -e ".[dev]"
  echo "$WANT" > "$STAMP"
fi
"$VENV/bin/python" -c 'import sys, torch, lightning, torchmetrics, numpy
print(f"ddpopt: {sys.argv[1]} set: python {sys.version.split()[0]}, torch {torch.__version__}, lightning "
      f"{lightning.__version__}, torchmetrics {torchmetrics.__version__}, numpy {numpy.__version__}")' "$SET"
"$VENV/bin/python" -m pytest "$@"
