#!/usr/bin/env bash
# Where the stack's time goes under load: the serving benchmark's stack (8B shape on the GPU, c32 by
# default) while py-spy samples the router, prefill and decode processes; the collapsed stacks per thread
# land in $OUT/pyspy-<role>.txt (read them with bench/pyspy_top.py).
#   OUT=... bench/profile_stack.sh [MODEL_DIR] [CONCURRENCY] [SECONDS]
set -uo pipefail
OUT=${OUT:-out/profile}; mkdir -p "$OUT"
MODEL=${1:-}; CONC=${2:-32}; SECS=${3:-15}
PYSPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
args=(--workdir /tmp/profile --skip-engine --workloads fixed --apis grpc --sweep "$CONC" --waves 4 --deadline-s 150
      --out "$OUT/profile_serving.json")
[ -n "$MODEL" ] && args+=(--model "$MODEL")
python3 bench/bench_serving.py "${args[@]}" > "$OUT/profile_serving.log" 2>&1 &
bench=$!
for _ in $(seq 120); do  # wait until the three services serve and the point's requests flow
  sleep 1
  [ "$(grep -c first_token /tmp/profile/logs-auto/decode.log 2>/dev/null)" -gt 40 ] 2>/dev/null && break
done
for role in decode router prefill; do
  pid=$(pgrep -f "services.cli serve $role" | head -1)
  [ -n "$pid" ] && "$PYSPY" record --pid "$pid" --duration "$SECS" --rate 200 --threads --nonblocking \
      --format raw --output "$OUT/pyspy-$role.txt" > "$OUT/pyspy-$role.log" 2>&1 &
done
wait "$bench"
wait
grep -a "^stack" "$OUT/profile_serving.log" | sort -u
