#!/usr/bin/env bash
# GPU checks and benchmark in one go (~8 minutes on an H200), from a fresh copy of the repo with its venv:
#
#     bash benchmarks/gpu.sh            # results: benchmarks/results/gpu_*.json (+ .png), logs on stdout
#
# 1. nvidia-smi summary and torch's view of the device;
# 2. tests/test_gpu_sync.py: one decode round of every mode (greedy and sampled) syncs the host at most once;
# 3. the equivalence audit on CUDA in bfloat16 and float32: `batchspec generate` (the automatic batch size) then
#    `batchspec verify` (re-decodes every row with plain decoding, near-ties judged in the dtype's own units;
#    exit 1 on an unexplained mismatch);
# 4. bench.py in bfloat16: ar / auto / exspec (k 1 3 5) / hf at batch 1 (few prompts, one pass) and at
#    batch 8 and 32 (more prompts, palindrome order). Engine modes must equal ar (exit 1 otherwise).
# Sizes can be overridden: B1_PROMPTS, B1_TOKENS, PROMPTS, TOKENS.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -f .venv/bin/activate ]]; then . .venv/bin/activate; fi
export PYTHONUNBUFFERED=1
RESULTS=benchmarks/results
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$RESULTS"
start=$SECONDS
last=$SECONDS
step() {  # step NAME: prints the time the previous step took and the total so far
  echo
  echo "=== $1   (previous step $((SECONDS - last)) s, total $((SECONDS - start)) s)"
  last=$SECONDS
}

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu,temperature.gpu --format=csv
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', \
transformers.__version__, 'device', torch.cuda.get_device_name(0), 'available', torch.cuda.is_available())"

step "host syncs per round (tests/test_gpu_sync.py)"
python -m pytest -q tests/test_gpu_sync.py

for dtype in bfloat16 float32; do
  step "equivalence audit, cuda $dtype: generate + verify"
  batchspec generate sample_data/prompts.jsonl "$TMP/o_$dtype.parquet" --device cuda --dtype "$dtype" --overwrite \
    --batch-size auto --log-json "$TMP/log_$dtype.jsonl"
  grep '"batch_size"' "$TMP/log_$dtype.jsonl" || true   # the width the run measured
  batchspec verify "$TMP/o_$dtype.parquet" --device cuda
done

step "bench, bfloat16, batch 1"
python benchmarks/bench.py --device cuda --dtype bfloat16 --prompts "${B1_PROMPTS:-12}" \
  --max-new-tokens "${B1_TOKENS:-64}" --modes ar auto exspec hf -k 1 3 5 --batch-sizes 1 --order given \
  --out "$RESULTS/gpu_bf16_b1.json"

step "bench, bfloat16, batch 8 and 32"
python benchmarks/bench.py --device cuda --dtype bfloat16 --prompts "${PROMPTS:-64}" \
  --max-new-tokens "${TOKENS:-96}" --modes ar auto exspec hf -k 1 3 5 --batch-sizes 8 32 \
  --out "$RESULTS/gpu_bf16_b8_b32.json"

step "table"
python benchmarks/table.py "$RESULTS/gpu_bf16_b1.json" "$RESULTS/gpu_bf16_b8_b32.json"
echo
echo "done in $((SECONDS - start)) s; results: $RESULTS/gpu_bf16_b1.json $RESULTS/gpu_bf16_b8_b32.json"
