#!/usr/bin/env bash
# The 8B-shape timing of issue 16's measurement again, without training (one device call, ~3 minutes): a
# random pair of the house shape widened to Llama-3.1-8B's shape like the trained one (a step's cost does
# not depend on the weights), batch-1 output tok/s of plain decoding and of each speculative
# configuration in the warmed engine, and the speedups with the accept lengths a gpu_house.sh run
# measured on the trained pair (its measure.json, carried with the call).
#
#   OUT=/path bench/house/gpu_house_speed.sh path/to/measure.json            # the GPU run
#   OUT=/path bench/house/gpu_house_speed.sh path/to/measure.json --smoke    # the CPU form (seconds)
set -uo pipefail
OUT=${OUT:-out/house-speed}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
accept=${1:?usage: gpu_house_speed.sh MEASURE_JSON [--smoke]}
if [[ ${2:-} == --smoke ]]; then
  flags=(--shape small --device cpu --dtype float32 --speed-prompts 1 --speed-tokens 8)
else
  flags=(--shape 8b --device cuda --dtype bfloat16 --deadline-s "${TOTAL_S:-540}")
fi
python3 -m bench.house.measure --random-pair --accept-from "$accept" --out "$OUT/speed.json" "${flags[@]}" \
  2> "$OUT/speed.log"
rc=$?
tail -n 5 "$OUT/speed.log"
exit "$rc"
