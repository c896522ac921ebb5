#!/usr/bin/env bash
# The pretrained example on the device machine: the GGUF arrives in two carried parts (.carry-a,
# .carry-b: at most 64 MiB travel per call), is reassembled and converted there (weights only;
# the tokenizer files are carried, made by make_model.py here), then examples/smollm2/job.yaml runs.
set -uo pipefail
export PYTHONUNBUFFERED=1 RLFLEET_COMMIT=${RLFLEET_COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry-a/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cat .carry-a/gguf.partaa .carry-b/gguf.partab > /tmp/smollm2.gguf
python3 examples/smollm2/make_model.py --gguf /tmp/smollm2.gguf --weights-only --out examples/smollm2/model || exit 1
cp .carry-a/tokenizer.json .carry-a/tokenizer_config.json examples/smollm2/model/
cd examples/smollm2 && timeout 420 python3 -m services.cli run job.yaml --no-progress --output-dir "$OUT/smollm2" \
  --summary "$OUT/smollm2/summary.json" 2>&1 | grep -v -i "warn" | tail -60
