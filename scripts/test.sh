#!/usr/bin/env bash
# The README's test command: set up .venv from nothing, lint, type-check, run the test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
.venv/bin/ruff check lightning_ddpopt tests examples benchmarks
.venv/bin/ruff format --check lightning_ddpopt tests examples benchmarks
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
