#!/usr/bin/env bash
# Several quality-benchmark runs at once on one machine (a GPU that one MiniLM run leaves
# mostly idle), each a `bench/quality.py` invocation of one method and seed, in the order of
# a jobs file, until a time budget; then, per dataset, the parts are merged (`--combine`) and
# compared (`bench/significance.py`, against the peer and ANCE family vs baselines).
#
#   LANES=9 BUDGET_S=470 bash bench/quality_lanes.sh bench/quality-gpu-jobs.txt
#
# Jobs file: one run a line, `DATASET METHOD SEED LABEL [quality.py options...]`, DATASET a
# name of `bench/quality.py --data` (scifact, nfcorpus) or a folder under DATA_ROOT.
# Environment: PROFILE (gpu), LANES (4), BUDGET_S (3600: no job starts with under 60 s left,
# and a job still running at the end is stopped), MAX_MINUTES (30: one run's limit; cpu-long
# runs take up to 35 min on 2 cores), MODEL (an encoder folder; default the
# MiniLM package), DATA_ROOT (folder of the datasets; default ../shared/data), WORK
# (/tmp/quality-lanes: runs/, parts/<dataset>/, logs/, reports/), STEPS (override, for a
# dry run). Reports land in $WORK/reports as quality-<profile>[-<dataset>] (SciFact unsuffixed).
# docs/benchmarks/quality-gpu.md was made this way on an H200 (docs/benchmarks/quality-peer.md).
set -u
cd "$(dirname "$0")/.."
JOBS=${1:?usage: bench/quality_lanes.sh JOBS_FILE}
PY=${PY:-python3}
REPO=$PWD
PROFILE=${PROFILE:-gpu}
LANES=${LANES:-4}
DATA_ROOT=${DATA_ROOT:-$REPO/../shared/data}
WORK=${WORK:-/tmp/quality-lanes}
t0=$(date +%s)
DEADLINE=$(( t0 + ${BUDGET_S:-3600} ))
MODEL_ARG=${MODEL:+--model $MODEL}
STEPS_ARG=${STEPS:+--steps $STEPS}
MAX_MINUTES=${MAX_MINUTES:-30}
mkdir -p "$WORK/runs" "$WORK/parts" "$WORK/logs" "$WORK/reports"
export PY REPO PROFILE DATA_ROOT WORK DEADLINE MODEL_ARG STEPS_ARG MAX_MINUTES

run_job() {
  read -r dataset method seed label options <<< "$1"
  local left=$(( DEADLINE - $(date +%s) )) started=$(date +%s)
  if [ "$left" -lt 60 ]; then echo "skipped $dataset $label seed $seed (${left} s left)"; return 0; fi
  # shellcheck disable=SC2086
  timeout "$left" "$PY" "$REPO/bench/quality.py" --profile "$PROFILE" \
    --data "$DATA_ROOT/$dataset" --methods "$method" --seeds "$seed" \
    --runs-dir "$WORK/runs/$dataset-$label" --out "$WORK/parts/$dataset" \
    --name "$PROFILE-$dataset-$label-s$seed" --max-minutes-per-run "$MAX_MINUTES" \
    $MODEL_ARG $STEPS_ARG $options > "$WORK/logs/$dataset-$label-s$seed.log" 2>&1
  echo "$dataset $label seed $seed: exit $? after $(( $(date +%s) - started )) s"
}
export -f run_job

echo "$(grep -vc '^\s*\(#\|$\)' "$JOBS") jobs, $LANES at a time, $(( DEADLINE - t0 )) s"
grep -v '^\s*\(#\|$\)' "$JOBS" | tr '\n' '\0' | xargs -0 -P "$LANES" -I{} bash -c 'run_job "$1"' _ {}

for parts in "$WORK"/parts/*/; do
  [ -d "$parts" ] || continue  # no job finished: nothing to merge
  dataset=$(basename "$parts")
  name=quality-$PROFILE; [ "$dataset" = scifact ] || name=$name-$dataset
  (cd "$parts" && "$PY" "$REPO/bench/quality.py" --combine $(ls "$PROFILE"-*.json) \
    --out "$WORK/reports" --name "$name") > "$WORK/logs/combine-$dataset.log" 2>&1 \
    || { echo "merging $dataset failed: $WORK/logs/combine-$dataset.log"; continue; }
  runs=$(ls -d "$WORK/runs/$dataset"-*)
  # shellcheck disable=SC2086
  "$PY" "$REPO/bench/significance.py" "$WORK/reports/$name.json" --runs-dir $runs \
    --reference st-static --name "$name-significance-vs-peer" --out "$WORK/reports" \
    > "$WORK/logs/significance-vs-peer-$dataset.log" 2>&1 || echo "no comparison with the peer ($dataset)"
  # shellcheck disable=SC2086
  "$PY" "$REPO/bench/significance.py" "$WORK/reports/$name.json" --runs-dir $runs \
    --name "$name-significance" --out "$WORK/reports" \
    > "$WORK/logs/significance-$dataset.log" 2>&1 || echo "no significance table ($dataset)"
  sed -n '/^| method/,/^$/p' "$WORK/reports/$name.md"
done
echo "reports in $WORK/reports after $(( $(date +%s) - t0 )) s"
