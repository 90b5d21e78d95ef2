#!/usr/bin/env bash
# The tiny trained pair (target + EAGLE-3 head, a few MB each) on one GPU in one device call (~3 minutes),
# measured on the CPU as the demo runs it. Run from the project root; carry ./.whl (the Python packages the
# GPU image lacks: ../shared/tools/gpu-wheels.sh) with the call.
#
#   OUT=/path bench/house/gpu_tiny_pair.sh                    # the GPU run
#   OUT=/path bench/house/gpu_tiny_pair.sh --smoke --device cpu  # the CPU form (seconds; tests/unit/training)
#
# Any other flag goes to python -m bench.house.tiny_pair (--target-seconds, --head-steps, --cpu-prompts ...).
# $OUT gets tiny-pair.tar (target/ and eagle3/ and tiny_pair.json: unpack it into models/tiny-pair/),
# tiny_pair.json (the training record) and tiny_pair.log.
set -uo pipefail
OUT=${OUT:-out/tiny-pair}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout "${TINY_PAIR_TIMEOUT_S:-540}" python3 -m bench.house.tiny_pair --out "$OUT" "$@" 2>&1 | tee "$OUT/tiny_pair.log"
rc=${PIPESTATUS[0]}
echo "gpu_tiny_pair: exit $rc" | tee -a "$OUT/tiny_pair.log"
exit "$rc"
