#!/usr/bin/env bash
# Set up, then train all-MiniLM-L6-v2 on SciFact with ANCE negatives (embedded mode).
# SciFact: ANCE_SCIFACT_DIR if set, else ../shared/data/scifact (the config's data.path) if it
# is there, else data/scifact, fetched once with `ance-train data get beir/scifact` (the
# archive's md5 checked against the one BEIR publishes).
#   bash scripts/quickstart.sh [CONFIG] [ance-train run options, e.g. --set training.steps=40]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
config=configs/quickstart.yaml
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then config="$1"; shift; fi
args=()
if [ "$config" = configs/quickstart.yaml ]; then
  if [ -n "${ANCE_SCIFACT_DIR:-}" ]; then
    args=(--set "data.path=$(realpath "$ANCE_SCIFACT_DIR")")
  elif [ ! -f ../shared/data/scifact/corpus.jsonl ]; then
    if [ ! -f data/scifact/corpus.jsonl ]; then
      echo "SciFact is not at ../shared/data/scifact: downloading it into data/scifact"
      ance-train data get beir/scifact --to data/scifact
    fi
    args=(--set "data.path=$PWD/data/scifact")
  fi
fi
exec ance-train run --config "$config" --overwrite ${args[@]+"${args[@]}"} "$@"
