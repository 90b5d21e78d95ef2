#!/usr/bin/env bash
# The adaptive speculation policy at Llama-3.1-8B's shape with real acceptance, in one device call (<= 9.5
# minutes on an H100): models/tiny-pair widened to 8B shape and 128256 ids, then the warmed engine at
# concurrency 1, 8, 32, 64 for plain decoding, chains of 1, 2 and 3, a tree (topk 4, 4 steps, 8 tokens) and the
# adaptive policy choosing among them per step, on prompts of held-out text (bench.house.adaptive). Run from the project root; carry ./.whl
# (../shared/tools/gpu-wheels.sh) with the call.
#
#   OUT=/path bench/house/gpu_adaptive.sh            # the GPU run
#   OUT=/path bench/house/gpu_adaptive.sh --smoke    # the CPU form: small shapes (tests/unit/training)
#
# Any other flag goes to python -m bench.house.adaptive (--sweep, --fixed, --point-seconds, --deadline-s).
# $OUT gets plain.json, chain1.json, chain2.json, chain3.json, tree.json, adaptive.json, adaptive_table.json and
# adaptive.log (8 files, as many as a device call brings back); the table is printed at the end.
set -uo pipefail
OUT=${OUT:-out/adaptive}
# The widened pair (~16 GB) goes to memory when /dev/shm has room: four engines load it, and a slow disk
# would spend a minute writing it.
if [[ -z ${WORK:-} ]]; then
  shm_kb=$(df -k --output=avail /dev/shm 2>/dev/null | tail -n 1)
  if [[ ${shm_kb:-0} =~ ^[0-9]+$ && ${shm_kb:-0} -gt $((40 << 20)) ]]; then
    WORK=$(mktemp -d /dev/shm/adaptive-XXXX)
  else
    WORK=$(mktemp -d /tmp/adaptive-XXXX)
  fi
  trap 'rm -rf "$WORK"' EXIT  # ours: freed at the end (memory, when under /dev/shm)
fi
echo "gpu_adaptive: work directory $WORK" >&2
mkdir -p "$OUT" "$WORK"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout "${ADAPTIVE_TIMEOUT_S:-555}" python3 -m bench.house.adaptive --out "$OUT" --work "$WORK" "$@" 2>&1 \
  | tee "$OUT/adaptive.log"
rc=${PIPESTATUS[0]}
echo "gpu_adaptive: exit $rc" | tee -a "$OUT/adaptive.log"
exit "$rc"
