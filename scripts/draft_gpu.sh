#!/usr/bin/env bash
# Distil the default draft on one GPU in a fixed time budget (issue 3). Reproducible recipe:
#
#   scripts/draft_gpu.sh OUT_DIR SPEC_BENCH.jsonl MT_BENCH.jsonl
#
# 1. `specrl draft data` for DATA_SEC seconds: the target's greedy continuations of the
#    held-out and train prompts, the train prompts' own text, then as many sampled rounds
#    (T = 0.7 / 1.0) as fit. Killing it is safe: shards are written atomically and a rerun
#    continues where it stopped.
# 2. `specrl draft train` on what is on disk, one run per entry of LAYERS in parallel (the GPU
#    has room), EPOCHS passes over the data, capped at TRAIN_MIN minutes each, then export.
#
# Everything lands in OUT_DIR: one exported draft per variant (draft.safetensors + card.json
# with the learning curve) and the logs. Environment overrides: MODEL, DEVICE, DATA_SEC,
# TRAIN_MIN, EPOCHS, LAYERS ("0,1 0,29"), SHORTLIST, LR, BATCH_TOKENS, ROUNDS, SAMPLES,
# GEN_BATCH, TOKEN_BUDGET, SPECRL.
#
# Generation throughput: a generate call costs one sequential step per new token whatever its
# rows, and the run of 2026-12-04 (512 rows, 400k-token budget, 1 sample) made only 1.6-2.1k
# labelled tokens/s on an H200 because ~420 training prompts fill a few small calls per round.
# SAMPLES continuations per prompt in one call (sampled rounds) fill the rows instead. Memory:
# SmolLM2-135M's float32 KV cache is ~46 KB per token, so TOKEN_BUDGET (rows x width per call)
# 1.5M needs ~70 GB of cache plus ~1 GB of logits per step at 4096 rows. Not yet run at these
# sizes (no GPU since); if the first call runs out of memory, halve TOKEN_BUDGET.
set -uo pipefail
OUT=${1:?usage: scripts/draft_gpu.sh OUT_DIR SPEC_BENCH.jsonl MT_BENCH.jsonl}
SPEC=${2:?spec-bench question.jsonl}
MT=${3:?mt-bench question.jsonl}
MODEL=${MODEL:-default}
DEVICE=${DEVICE:-cuda}
DATA_SEC=${DATA_SEC:-240}
TRAIN_MIN=${TRAIN_MIN:-2.5}
EPOCHS=${EPOCHS:-6}
LAYERS=${LAYERS:-"0,1 0,29"}
SHORTLIST=${SHORTLIST:-16384}
LR=${LR:-1e-3}
BATCH_TOKENS=${BATCH_TOKENS:-32768}
ROUNDS=${ROUNDS:-400}
SAMPLES=${SAMPLES:-8}
GEN_BATCH=${GEN_BATCH:-4096}
TOKEN_BUDGET=${TOKEN_BUDGET:-1500000}
SPECRL=${SPECRL:-python3 -m specrl}
mkdir -p "$OUT"
DATA=(--model "$MODEL" --device "$DEVICE" --prompts builtin --prompts "$SPEC" --prompts "$MT"
      --gen-dtype float32 --gen-batch-size "$GEN_BATCH" --token-budget "$TOKEN_BUDGET" --rounds "$ROUNDS"
      --samples "$SAMPLES" --no-progress)

start=$(date +%s)
timeout "$DATA_SEC" $SPECRL draft data "${DATA[@]}" 2>&1 | tee "$OUT/data.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; then echo "draft data failed ($rc)" >&2; exit "$rc"; fi
echo "data: $(( $(date +%s) - start )) s" | tee -a "$OUT/data.log"

# labelled train tokens on disk -> the schedule length (EPOCHS passes)
TOKENS=$(python3 -c '
import sys
from specrl.drafttrain.data import count_tokens
from specrl.models import cache_root, display_name
data = cache_root() / "drafttrain" / display_name(sys.argv[1]).replace("/", "--") / "data"
print(sum(v for k, v in count_tokens(data).items() if k.startswith("train")))' "$MODEL")
echo "train tokens on disk: $TOKENS" | tee -a "$OUT/data.log"

pids=()
for layers in $LAYERS; do
  name="L${layers//,/-}"
  $SPECRL draft train "${DATA[@]}" --skip-data --run "gpu-$name" --layers "$layers" --shortlist "$SHORTLIST" \
    --lr "$LR" --batch-tokens "$BATCH_TOKENS" --train-tokens $(( TOKENS * EPOCHS )) --eval-every 40 \
    --max-minutes "$TRAIN_MIN" --export "$OUT/draft-$name" > "$OUT/train-$name.log" 2>&1 &
  pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
tail -n 3 "$OUT"/train-*.log
echo "total: $(( $(date +%s) - start )) s"
exit $fail
