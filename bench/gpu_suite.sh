#!/usr/bin/env bash
# The GPU set, on a two-H200 machine with vLLM 0.24.0 and the project's dependencies installed:
#   bash bench/gpu_suite.sh [tests|sync|pattern|throughput|latency|scaling|resume ...]   (default: all)
# Each result lands in $OUT (or .artifacts/gpu): JSON lines in bench-gpu.jsonl, logs beside
# (sync: per-bucket traces of the trainer in sync.log, of the worker in sync-worker.log;
# SYNC_ARGS adds arguments, e.g. SYNC_ARGS="--direct-mib 16 0"; THROUGHPUT_ARGS (default
# "--rounds 5": medians of 5 rounds), LATENCY_ARGS, SCALING_ARGS and RESUME_ARGS likewise).
set -uo pipefail
OUT=${OUT:-.artifacts/gpu}
mkdir -p "$OUT" .models
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
if ! redis-cli -p 6379 ping >/dev/null 2>&1 && ! python3 -c "import redis; redis.Redis(socket_connect_timeout=1).ping()" 2>/dev/null; then
  valkey-server --port 6379 --bind 127.0.0.1 --save "" --appendonly no --daemonize yes >/dev/null
fi
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
nvidia-smi -L | tee "$OUT/gpus.txt"
steps=${*:-tests sync pattern throughput latency scaling resume}
cleanup() { pkill -f -- "-m rollout_queue.cli worker" 2>/dev/null; sleep 3; pkill -9 -f -- "-m rollout_queue.cli worker" 2>/dev/null; pkill -9 -f "VLLM::" 2>/dev/null; true; }
for step in $steps; do
  cleanup
  start=$(date +%s)
  case $step in
    tests)      timeout 480 python3 -m pytest -p no:cacheprovider -q -s -m gpu tests/test_gpu.py > "$OUT/gpu-tests.txt" 2>&1 ;;
    sync)       RQ_SYNC_TRACE=1 timeout 300 python3 bench/weight_transfer.py --device cuda --shape qwen2-7b ${SYNC_ARGS:-} >> "$OUT/bench-gpu.jsonl" 2> "$OUT/sync.log"
                cp .artifacts/bench-weight-sync/worker-0.log "$OUT/sync-worker.log" 2>/dev/null ;;
    pattern)    timeout 200 python3 bench/sync_pattern.py --device cuda >> "$OUT/bench-gpu.jsonl" 2> "$OUT/pattern.log" ;;
    throughput) python3 bench/throughput.py --device cuda ${THROUGHPUT_ARGS---rounds 5} >> "$OUT/bench-gpu.jsonl" 2> "$OUT/throughput.log" ;;
    latency)    python3 bench/latency.py --device cuda ${LATENCY_ARGS:-} >> "$OUT/bench-gpu.jsonl" 2> "$OUT/latency.log" ;;
    scaling)    python3 bench/scaling.py --device cuda ${SCALING_ARGS:-} >> "$OUT/bench-gpu.jsonl" 2> "$OUT/scaling.log" ;;
    resume)     python3 bench/resume.py --device cuda ${RESUME_ARGS:-} >> "$OUT/bench-gpu.jsonl" 2> "$OUT/resume.log" ;;
    *) echo "unknown step $step" >&2 ;;
  esac
  rc=$?
  cleanup
  echo "$step: rc=$rc in $(( $(date +%s) - start ))s" | tee -a "$OUT/steps.txt"
done
cat "$OUT/bench-gpu.jsonl" 2>/dev/null
