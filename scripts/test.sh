#!/usr/bin/env bash
# Set up, then lint and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check src services tests bench
# --durations: CI lists the slowest tests, to keep the suite well under 15 minutes.
python -m pytest -q -p no:cacheprovider --durations=15 "$@"
