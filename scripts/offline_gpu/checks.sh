#!/usr/bin/env bash
# The checks only a GPU can show, on a lent GPU machine without network access, in two calls
# in a row (scripts/offline_gpu/pack_checks.sh says what each carries): FAISS on the GPU (a
# sanity check against the CPU, then the ANN test modules, whose index.device `auto` then
# picks the GPU), bench/indexer.py on the GPU and on the CPU of the same machine, the
# encoder's MFU (bench/encode.py --device cuda), and with NCCL=1 whether NCCL runs two ranks
# on one GPU (it does not: gpu-checks.md).
# Each step has its own time limit and the results are re-packed into $OUT/checks.tgz after
# each, so a call stopped at its limit still brings back what finished.
#
#   bash scripts/offline_gpu/checks.sh stage  # call 1: keep .offline/c in /tmp/stage
#   bash scripts/offline_gpu/checks.sh        # call 2: at most 11 min (the steps' limits)
#
# docs/benchmarks/gpu-checks.md has what it showed on an H200.
set -u
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
OUT=${OUT:-/tmp/offline-out}; RES=/tmp/checks; mkdir -p "$OUT" "$RES"
t0=$(date +%s); stamp() { echo "[checks +$(( $(date +%s) - t0 )) s] $*"; }
pack() { (cd "$RES" && tar -czf "$OUT/checks.tgz" .); }
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $RES/NAME.log
  local name=$1 limit=$2; shift 2
  stamp "$name (limit $limit s)"
  timeout "$limit" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc" | tee -a "$RES/exits.txt"; tail -6 "$RES/$name.log"; pack
}
mkdir -p /tmp/stage
cp -r .offline/c/. /tmp/stage/ 2>/dev/null
[ "${1:-}" = stage ] && { ls -la /tmp/stage; exit 0; }
cp -r .offline/d/. /tmp/stage/ 2>/dev/null
[ -f /tmp/stage/faiss-gpu.tar.xz.part-aa ] && [ -f /tmp/stage/faiss-gpu.tar.xz.part-ab ] \
  || { echo "FAISS's two parts are not both in /tmp/stage: run 'checks.sh stage' first"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site /tmp/stage/whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/cu12 \
  /tmp/stage/nvidia_cuda_runtime_cu12-*.whl || exit 1
cat /tmp/stage/faiss-gpu.tar.xz.part-* | xz -d | tar -xf - -C /tmp/site || exit 1
# CUDA 12's libraries come from LD_LIBRARY_PATH below, not from pip's nvidia-*-cu12 packages
# that FAISS's __init__ (faiss-gpu) or loader (faiss-gpu-cu12) would preload.
rm -f /tmp/site/faiss/_gpu_build.py
export _FAISS_WHEEL_DISABLE_CUDA_PRELOAD=1
mkdir -p /tmp/data && tar -xJf .offline/a/data.tar.xz -C /tmp/data || exit 1
cublas13=$(python3 - <<'PY'
import glob, site, sys
roots = site.getsitepackages() + [sys.prefix, "/usr/local/cuda", "/usr/local/cuda/lib64"]
hits = [h for r in roots for h in glob.glob(f"{r}/**/libcublas.so.13*", recursive=True)]
print(hits[0].rsplit("/", 1)[0] if hits else "")
PY
)
[ -n "$cublas13" ] || { echo "no libcublas.so.13 on this machine"; exit 1; }
export LD_LIBRARY_PATH=/tmp/stage/lib:/tmp/cu12/nvidia/cuda_runtime/lib:$cublas13:${LD_LIBRARY_PATH:-}
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/dev
# ance-train runs from src/, not installed: its entry points (the negative strategies).
python3 scripts/offline_gpu/dist_info.py /tmp/site || exit 1
stamp "installed; cuBLAS 13 from $cublas13"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RES/gpu.txt"
nproc >> "$RES/gpu.txt"

step faiss-sanity 60 python3 scripts/offline_gpu/faiss_gpu_sanity.py "$RES/faiss-sanity.json"
step ann-tests 120 python3 -m pytest -q --noconftest -p no:cacheprovider -x \
  tests/test_ann.py tests/test_ann_types.py tests/test_partition_merge.py \
  tests/test_cosine_once.py tests/test_capacity.py
step indexer-gpu 150 python3 bench/indexer.py --device gpu --sizes 100000 1000000 \
  --types flat ivf --queries 2000 --nlist 1000000=1000 --out "$RES/indexer-gpu"
step indexer-cpu 150 python3 bench/indexer.py --device cpu --sizes 100000 1000000 \
  --types flat ivf --queries 2000 --nlist 1000000=1000 --out "$RES/indexer-cpu"
step mfu 150 python3 bench/encode.py --device cuda --model .offline/a/tokenizer \
  --data /tmp/data/scifact --docs 2000 --repeats 1 --out "$RES/mfu"
[ -n "${NCCL:-}" ] && step nccl-one-gpu 45 python3 scripts/offline_gpu/nccl_one_gpu.py
stamp done
ls -la "$OUT"
