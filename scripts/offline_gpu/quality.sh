#!/usr/bin/env bash
# Second call on the GPU machine (carrying .offline/b; smoke.sh ran before on the same
# machine): MiniLM widened back to float32, then bench/quality_lanes.sh over a jobs file,
# and one tarball of reports, parts, logs and run summaries (no embeddings) in $OUT.
#
#   LANES=9 BUDGET_S=470 bash scripts/offline_gpu/quality.sh [JOBS_FILE]
set -u
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
OUT=${OUT:-/tmp/offline-out}; mkdir -p "$OUT"
[ -d /tmp/site ] && [ -d /tmp/data/scifact ] || { echo "smoke.sh's /tmp/site is gone: run it first"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/dev
python3 - <<'PY' || exit 1
import shutil
import torch
from safetensors.torch import load_file, save_file
shutil.copytree(".offline/b/minilm", "/tmp/minilm", dirs_exist_ok=True)
weights = load_file(".offline/b/minilm/model.safetensors")
save_file({k: v.to(torch.float32) for k, v in weights.items()}, "/tmp/minilm/model.safetensors",
          metadata={"format": "pt"})
PY
MODEL=/tmp/minilm DATA_ROOT=/tmp/data WORK=/tmp/quality-lanes PY=python3 \
  bash bench/quality_lanes.sh "${1:-bench/quality-gpu-jobs.txt}"
(cd /tmp/quality-lanes && tar -czf "$OUT/quality.tgz" reports parts logs \
  $(find runs -name summary.json -o -name '*.yaml' -o -path '*/eval/*.json') 2>/dev/null)
ls -la "$OUT"
