#!/usr/bin/env bash
# GPU tests and benchmarks on any CUDA machine, one stage after another, each under its own time limit:
#   bash bench/device.sh gpu-tests-a gpu-tests-b      # the whole GPU suite (two stages of < 10 minutes each)
#   bash bench/device.sh parity sweep kernels         # benchmarks: results and PNGs land in $OUT
# Stages: gpu-tests-a, gpu-tests-b, engine-tests, parity-tests, service-tests, lifecycle, ppo, sglang,
# megatron-tests, parity, sweep, sweep-quick, rl, gap, kernels, train-bench, train-bench-quick.
# OUT (default ./bench-out) receives logs and result files. Python packages come from the environment;
# on a machine with no package index, put wheels in .whl/ (and megatron-core's in .whl-mcore/) and they
# are installed under /tmp/site first. Stage sglang reads SGLang's request types from the pinned wheel
# (or a zip of its sglang/ folders) in .whl-sglang/.
set -uo pipefail
export PYTHONUNBUFFERED=1
export RLFLEET_COMMIT=${RLFLEET_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
wheels=$(ls .whl/*.whl .whl-mcore/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
for stage in "$@"; do
  echo "=== $stage ($(date +%T))"
  case $stage in
    engine-tests) timeout 300 python3 -m pytest -q --timeout 240 tests/gpu/test_engine_gpu.py tests/gpu/test_rollout_updates_gpu.py 2>&1 | tee "$OUT/engine-tests.log" | tail -40 ;;
    ppo) timeout 420 python3 -m pytest -q --timeout 400 -rA -s tests/gpu/test_ppo_gpu.py 2>&1 | tee "$OUT/ppo-gpu.log" | grep -E "^actor|^rewards|PASS|FAIL|ERROR|passed|failed|^E " | tail -30 ;;
    sglang) RLFLEET_SGLANG_WHEEL=$(ls $PWD/.whl-sglang/*.zip 2>/dev/null | head -1) timeout 300 python3 -m pytest -q --timeout 240 -rA -s tests/gpu/test_sglang_ipc_gpu.py 2>&1 | tee "$OUT/sglang-gpu.log" | grep -E "^sglang|PASS|FAIL|ERROR|passed|failed|^E " | tail -30 ;;
    lifecycle) timeout 120 python3 -m pytest -q --timeout 100 tests/gpu/test_lifecycle_gpu.py 2>&1 | tail -5 ;;
    service-tests) timeout 300 python3 -m pytest -q --timeout 240 -rA tests/gpu/test_never_mixed_gpu.py tests/gpu/test_seed_scenario_gpu.py 2>&1 | tee "$OUT/service-tests.log" | grep -E "^step|PASS|FAIL|passed|failed|^E " | tail -30 ;;
    # The whole GPU suite takes longer than one device call (600 s): run it in two calls.
    gpu-tests-a) timeout 560 python3 -m pytest -q --timeout 240 -rA tests/gpu/test_[c-m]*.py 2>&1 | tee "$OUT/gpu-tests-a.log" | grep -E "PASS|FAIL|ERROR|passed|failed|^E " | tail -60 ;;
    gpu-tests-b) timeout 560 python3 -m pytest -q --timeout 240 -rA tests/gpu/test_[n-z]*.py 2>&1 | tee "$OUT/gpu-tests-b.log" | grep -E "PASS|FAIL|ERROR|passed|failed|^E " | tail -60 ;;
    sweep) timeout 300 python3 bench/rollout.py --device cuda --parts sweep --out "$OUT/rollout.jsonl" --png "$OUT/rollout.png" ;;
    parity) timeout 560 python3 bench/parity.py --device cuda --graphs ${PARITY_GRAPHS:-on,off} --out "$OUT/parity.jsonl" --png "$OUT/parity.png" 2>&1 | tee "$OUT/parity.log" | grep -vE "^\{" ;;
    parity-tests) timeout 400 python3 -m pytest -q --timeout 300 -rA tests/gpu/test_parity_gpu.py tests/gpu/test_engine_gpu.py 2>&1 | tee "$OUT/parity-tests.log" | grep -E "PASS|FAIL|ERROR|passed|failed|^E " | tail -40 ;;
    kernels) timeout 300 python3 bench/decode_kernels.py --out "$OUT/decode_kernels.jsonl" 2>&1 | tee "$OUT/decode_kernels.log" | grep "^#" ;;
    sweep-quick) timeout 200 python3 bench/rollout.py --device cuda --parts sweep --repeats 1 --no-profile --out "$OUT/rollout.jsonl" ;;
    rl) timeout 420 python3 bench/rollout.py --device cuda --parts rl --out "$OUT/rollout.jsonl" ;;
    gap) timeout 120 python3 bench/rollout.py --device cuda --parts gap --out "$OUT/rollout.jsonl" ;;
    megatron-tests) timeout 250 python3 -m pytest -q --timeout 200 -rA tests/gpu/test_megatron_gpu.py 2>&1 | tee "$OUT/megatron-tests.log" | grep -E "^step|held|PASS|FAIL|ERROR|passed|failed|^E " | tail -40 ;;
    train-bench) timeout 300 python3 bench/train_step.py --json --out "$OUT/train_step.jsonl" --png "$OUT/train_step.png" ;;
    train-bench-quick) timeout 300 python3 bench/train_step.py --json --shapes 0.5b --steps 2 --out "$OUT/train_step.jsonl" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
