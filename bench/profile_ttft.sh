#!/usr/bin/env bash
# Where the stack's TTFT goes at one concurrency on the GPU, in one device call: the serving benchmark (engine
# and stack, fixed 512:256, gRPC, WAVES x concurrency requests so the steady state outweighs the first wave),
# then bench/ttft_phases.py over the services' logs.
#   OUT=... bench/profile_ttft.sh [CONCURRENCY] [WAVES] [extra bench_serving flags...]
set -uo pipefail
OUT=${OUT:-out/ttft}; mkdir -p "$OUT"
CONC=${1:-32}; WAVES=${2:-4}; shift $(( $# > 2 ? 2 : $# ))
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
run() {  # NAME, bench_serving flags...
  local name=$1; shift
  rm -rf /tmp/ttft/logs-auto
  timeout "${RUN_S:-300}" python3 bench/bench_serving.py --workdir /tmp/ttft --workloads fixed --apis grpc \
    --sweep "$CONC" --waves "$WAVES" --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?; echo "$name: exit $rc"
  [ "$rc" = 0 ] || for f in /tmp/ttft/logs-auto/*.log; do echo "== $f"; grep -av '"event": "step_done"' "$f" | tail -4; done
  grep -a "TTFT\|tok/s" "$OUT/$name.log" | tail -6
  python3 bench/ttft_phases.py /tmp/ttft/logs-auto --json "$OUT/${name}_phases.json" | tee -a "$OUT/$name.log"
  mkdir -p "$OUT/${name}_logs" && cp /tmp/ttft/logs-auto/*.log "$OUT/${name}_logs/" 2>/dev/null
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for side, pts in [("engine", (d.get("engine") or {}).get("points", []))] + \
        [(f"stack[{s.get('transport')}]", s.get("points", [])) for s in d.get("stacks", [])]:
    for p in pts:
        print(f"{side:18s} {p['point']:10s} tok/s {p['output_tok_s']:8.1f}  TTFT p50 {p['ttft_p50_s']:.3f}"
              f"  steady p50 {p.get('ttft_steady_p50_s') or float('nan'):.3f} p99 {p.get('ttft_steady_p99_s') or float('nan'):.3f}")
PY
}
# The stack under MPS (bench_serving's default, as eyrie up's) with the engine beside it; then, with
# NO_MPS=1, the stack again without MPS (time-sliced) on the same checkpoint; BASE="flags": flags of the
# first run only.
read -ra base <<< "${BASE:-}"
[ "${SKIP_BASE:-0}" = 1 ] || run base --deadline-s "${BASE_DEADLINE_S:-330}" "${base[@]}" "$@"
model=(); [ -d /tmp/ttft/model/target ] && model=(--model /tmp/ttft/model/target)
if [ "${NO_MPS:-0}" = 1 ]; then
  run nomps --skip-engine --mps off "${model[@]}" --deadline-s "${NOMPS_DEADLINE_S:-200}" "$@"
fi
# ALT="flags": the stack once more with these bench_serving flags (e.g. ALT="--prefill-chunk-size 2048")
if [ -n "${ALT:-}" ]; then
  read -ra alt <<< "$ALT"
  run alt --skip-engine "${model[@]}" --deadline-s "${ALT_DEADLINE_S:-200}" "${alt[@]}" "$@"
fi
