#!/usr/bin/env bash
# Set up, then train all-MiniLM-L6-v2 on SciFact with ANCE negatives (embedded mode).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec ance-train run --config "${1:-configs/quickstart.yaml}" --overwrite
