#!/usr/bin/env bash
# The README's main job: set up .venv from nothing, then a real 2-process CPU DDP training run.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
.venv/bin/python examples/train_digits.py "$@"
