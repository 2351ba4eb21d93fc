#!/usr/bin/env bash
# Build the docs site strictly into site/ (what CI runs), or `serve` it at http://127.0.0.1:8000.
# Sets up .venv as the README's commands do, plus the pinned docs tools in requirements/docs.txt.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
DOCS_STAMP=.venv/.ddpopt-docs-installed
DOCS_WANT="$(sha256sum requirements/docs.txt | cut -d' ' -f1)"
if [ "$(cat "$DOCS_STAMP" 2>/dev/null)" != "$DOCS_WANT" ]; then
  echo "ddpopt: installing the docs tools into .venv"
  .venv/bin/python -m pip install --quiet -c requirements/ci.txt -r requirements/docs.txt
  echo "$DOCS_WANT" > "$DOCS_STAMP"
fi
export NO_MKDOCS_2_WARNING=1
if [ "${1:-build}" = "serve" ]; then
  exec .venv/bin/mkdocs serve
fi
.venv/bin/mkdocs build --strict --quiet
echo "ddpopt: docs built into site/"
