#!/usr/bin/env bash
# Runs a command on an emulated AVX2-only CPU (issue 29: the suite's time "on a machine with
# AVX2 only"): every library that dispatches on the CPU's instruction sets is held to AVX2
# (torch's own kernels, oneDNN, MKL, numpy, FAISS), and Python code reading /proc/cpuinfo
# sees no AVX-512, AMX or bf16 flags (avx2_only/sitecustomize.py), so inference.precision
# auto picks fp32 as it would there. The cores, caches and clocks stay this machine's: label
# what it measures as an emulation.
#   bash scripts/dev/avx2_only.sh bash scripts/test.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export ATEN_CPU_CAPABILITY=avx2
export ONEDNN_MAX_CPU_ISA=AVX2
export MKL_ENABLE_INSTRUCTIONS=AVX2
export NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"  # numpy 2.4's names
export FAISS_SIMD_LEVEL=AVX2  # FAISS 1.15's dynamic dispatch
export PYTHONPATH="$here/avx2_only${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
