#!/usr/bin/env bash
# The pretrained example on the device machine: the GGUF arrives in two carried parts (at most
# 64 MiB travel per call): a first call carries .carry-a (part 1, the tokenizer files made by
# make_model.py here, and the gguf / math-verify wheels) and copies it to /tmp/carry-a, which a
# warm machine keeps; this script, run by the next call with .carry-b (part 2) and .whl carried,
# reassembles the file, converts it (weights only: no transformers there), and runs
# examples/smollm2/$JOB (job.yaml by default; JOB=agent.yaml makes its data and runs the
# calculator agent job; JOB=async runs bench/async.py: job.yaml against async.yaml, one after the
# other, into $OUT/async.jsonl and $OUT/async.png).
set -uo pipefail
export PYTHONUNBUFFERED=1 RLFLEET_COMMIT=${RLFLEET_COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl /tmp/carry-a/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cat /tmp/carry-a/gguf.partaa .carry-b/gguf.partab > /tmp/smollm2.gguf
python3 examples/smollm2/make_model.py --gguf /tmp/smollm2.gguf --weights-only --out examples/smollm2/model || exit 1
cp /tmp/carry-a/tokenizer.json /tmp/carry-a/tokenizer_config.json examples/smollm2/model/
JOB=${JOB:-job.yaml}
if [ "$JOB" = agent.yaml ]; then python3 examples/smollm2/make_agent_data.py || exit 1; fi
if [ "$JOB" = async ]; then
  timeout 380 python3 bench/async.py --jobs examples/smollm2/job.yaml examples/smollm2/async.yaml \
    --out "$OUT/async.jsonl" --png "$OUT/async.png" 2>&1 | grep -v -i "warn" | tail -30
  exit "${PIPESTATUS[0]}"
fi
cd examples/smollm2 && timeout 420 python3 -m services.cli run "$JOB" --no-progress --output-dir "$OUT/smollm2" \
  --summary "$OUT/smollm2/summary.json" 2>&1 | grep -v -i "warn" | tail -60
