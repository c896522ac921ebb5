#!/usr/bin/env bash
# The pretrained example on the device machine. At most 64 MiB travel per call, the checkout
# included, so three calls on one warm machine bring it: one carries .whl and installs it under
# /tmp/site (bash bench/device.sh none), one carries .carry-a (the GGUF's first 50 MB and the gguf
# wheel) and copies it to /tmp/carry-a, and one runs this script with .carry-b (the rest of the
# GGUF, and the tokenizer files make_model.py made here). It reassembles the file, converts it
# (weights only: no transformers there), and runs examples/smollm2/$JOB (job.yaml by default;
# JOB=agent.yaml makes its data and runs the calculator agent job; JOB=async runs bench/async.py:
# job.yaml against async.yaml, one after the other, into $OUT/async.jsonl and $OUT/async.png).
set -uo pipefail
export PYTHONUNBUFFERED=1 RLFLEET_COMMIT=${RLFLEET_COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $(ls .whl/*.whl 2>/dev/null) /tmp/carry-a/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cat /tmp/carry-a/gguf.partaa .carry-b/gguf.partab > /tmp/smollm2.gguf
python3 examples/smollm2/make_model.py --gguf /tmp/smollm2.gguf --weights-only --out examples/smollm2/model || exit 1
cp .carry-b/tokenizer.json .carry-b/tokenizer_config.json examples/smollm2/model/
JOB=${JOB:-job.yaml}
if [ "$JOB" = agent.yaml ]; then python3 examples/smollm2/make_agent_data.py || exit 1; fi
if [ "$JOB" = async ]; then
  timeout 380 python3 bench/async.py --jobs examples/smollm2/job.yaml examples/smollm2/async.yaml \
    --out "$OUT/async.jsonl" --png "$OUT/async.png" 2>&1 | grep -v -i "warn" | tail -30
  exit "${PIPESTATUS[0]}"
fi
cd examples/smollm2 && timeout 420 python3 -m services.cli run "$JOB" --no-progress --output-dir "$OUT/smollm2" \
  --summary "$OUT/smollm2/summary.json" 2>&1 | grep -v -i "warn" | tail -60
