#!/usr/bin/env bash
# Creates (or reuses) .venv and installs the pinned torch, lightning, torchmetrics and this package into it.
# Sourced by the README's commands; needs only Python 3.10+.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
STAMP=.venv/.ddpopt-installed
WANT="$(cat requirements/ci.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "ddpopt: installing pinned dependencies into .venv (first run takes a few minutes)"
  .venv/bin/python -m pip install --quiet --upgrade pip
  # torch first and pinned, so nothing later resolves a different (CUDA) build.
  .venv/bin/python -m pip install --quiet "$(grep '^torch==' requirements/ci.txt)"
  .venv/bin/python -m pip install --quiet -c requirements/ci.txt -e ".[dev,ft]"
  echo "$WANT" > "$STAMP"
fi
