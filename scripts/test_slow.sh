#!/usr/bin/env bash
# The slow variants the README's test command leaves out (every launcher, 3 x 2 and 2 x 4 nodes, the other
# kill-and-heal cases, every hook's convergence...): what CI runs once, on the pinned set. Sets up .venv as
# scripts/test.sh does.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
SECONDS=0
.venv/bin/python -m pytest -m slow --durations=15 "$@"
echo "ddpopt: the slow variants took $((SECONDS / 60)) min $((SECONDS % 60)) s"
