#!/usr/bin/env bash
# The "bring your own data and model" walk-through of docs/own-data-and-model.md, as a user
# would type it from a fresh clone: (query, positive) pairs converted into the BEIR layout,
# an encoder that is not the packaged one, a short embedded run, the model exported, the mined
# negatives exported as a training set.
#
#   bash scripts/dev/own_data_and_model.sh WORK_DIR
#
# The pairs are made from SciFact's training and test qrels (ANCE_SCIFACT_DIR, default
# ../shared/data/scifact): the form in which sentence-transformers users hold their data.
# The encoder is a small randomly initialised BERT (4 layers, hidden 128, the MiniLM
# vocabulary), saved as any Hugging Face model folder is: no other small encoder ships in a
# package this project can install, and a Hub model cannot be downloaded here.
set -euo pipefail
cd "$(dirname "$0")/../.."
work="$(realpath -m "${1:?usage: own_data_and_model.sh WORK_DIR}")"
scifact="${ANCE_SCIFACT_DIR:-$(realpath -m ../shared/data/scifact)}"
mkdir -p "$work"
# shellcheck disable=SC1091
. .venv/bin/activate
step() { printf '\n$ %s\n' "$*"; /usr/bin/time -f '(%e s)' "$@"; }

# 1. The user's pairs: one JSON object a line, {"query": ..., "positive": ...}.
python - "$scifact" "$work" <<'PY'
import json, sys
from pathlib import Path
scifact, work = Path(sys.argv[1]), Path(sys.argv[2])
docs = {}
for line in open(scifact / "corpus.jsonl"):
    d = json.loads(line)
    docs[d["_id"]] = (d.get("title", "") + ". " + d["text"]).strip()
queries = {json.loads(l)["_id"]: json.loads(l)["text"] for l in open(scifact / "queries.jsonl")}
for split in ("train", "test"):
    with open(work / f"{split}-pairs.jsonl", "w") as out:
        for row in (scifact / "qrels" / f"{split}.tsv").read_text().splitlines()[1:]:
            qid, did, score = row.split("\t")
            if int(score) > 0:
                out.write(json.dumps({"query": queries[qid], "positive": docs[did]}) + "\n")
PY
head -c 300 "$work/train-pairs.jsonl"; echo

# 2. Into the layout ance-train reads.
step ance-train data convert pairs "$work/train-pairs.jsonl" --test "$work/test-pairs.jsonl" \
  --dev-fraction 0.1 --to "$work/my-data"

# 3. The user's encoder: a Hugging Face model folder.
python - "$work/my-encoder" <<'PY'
import sys
import torch
from transformers import AutoTokenizer, BertConfig, BertModel
from ance_train.config import default_model_path
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=128, num_hidden_layers=4,
                    num_attention_heads=4, intermediate_size=512)
BertModel(config).save_pretrained(sys.argv[1], safe_serialization=True)
tokenizer.save_pretrained(sys.argv[1])
PY

# 4. The run's configuration: the quickstart's, with the user's data and model, prompts.
cat > "$work/my-run.yaml" <<YAML
run_id: my-run
output_dir: $work/runs
data: {format: beir, path: $work/my-data}
model:
  path: $work/my-encoder
  pooling: cls
  query_prompt: "query: "
  document_prompt: "passage: "
  max_query_length: 32
  max_doc_length: 128
training: {steps: 60, batch_size: 16, learning_rate: 1.0e-4, warmup_steps: 6,
           refresh_every: 20, torch_threads: 1, torch_threads_between_refreshes: 2}
negatives: {pool: ann, top_k: 20, per_query: 1, warmup: bm25}
inference: {replicas: 2, shard_size: 500, batch_size: 32, torch_threads: 1}
index: {eval_splits: [dev, test]}
YAML
step ance-train validate --config "$work/my-run.yaml"
step ance-train run --config "$work/my-run.yaml"
step ance-train export --run "$work/runs/my-run/config.yaml" --checkpoint best --out "$work/my-model"
step ance-train export-negatives --run "$work/runs/my-run" --checkpoint 40 \
  --format tevatron --out "$work/negatives-40.jsonl"
head -c 400 "$work/negatives-40.jsonl"; echo
