#!/usr/bin/env bash
# The README's test command: set up .venv from nothing, lint, type-check, run the test suite (every feature; the slow
# variants are scripts/test_slow.sh's), then print the 15 slowest tests and the wall time.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
SECONDS=0
.venv/bin/ruff check lightning_ddpopt tests examples benchmarks
.venv/bin/ruff format --check lightning_ddpopt tests examples benchmarks
.venv/bin/mypy
.venv/bin/python -m pytest --durations=15 "$@"
echo "ddpopt: lint, types and tests took $((SECONDS / 60)) min $((SECONDS % 60)) s"
