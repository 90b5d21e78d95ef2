#!/usr/bin/env bash
# The outside load generator: guidellm 0.8.1 against a running stack's OpenAI endpoint, offline, with the
# model's own tokenizer from disk. Synthetic prompts (guidellm's Faker text cut to PROMPT_TOKENS by that
# tokenizer), OUTPUT_TOKENS per request (max_tokens + ignore_eos, as guidellm sends them), one benchmark per
# concurrency of SWEEP, each ending at REQUESTS requests or POINT_SECONDS, whichever comes first. A cross-check
# of bench/bench_serving.py's own client: same endpoint, someone else's timing code.
#
#   bench/outside_load.sh URL TOKENIZER_DIR [OUT_DIR]
#   bench/outside_load.sh http://127.0.0.1:8000 /path/to/checkpoint out/guidellm      # the GPU workload
#   SMOKE=1 bench/outside_load.sh http://127.0.0.1:8000 models/tiny-pair/target /tmp/gl  # CPU: tiny, < 3 min
#
# URL: the router's OpenAI address without /v1 (`eyrie up --openai-port 8000` prints it). TOKENIZER_DIR: a
# directory with tokenizer.json (the checkpoint's). Environment: PROMPT_TOKENS (512), OUTPUT_TOKENS (256),
# SWEEP (1,8,32,64), REQUESTS (128 per point), POINT_SECONDS (60), ROUTE (/v1/completions, or
# /v1/chat/completions), MODEL (eyrie), EYRIE_API_KEY (sent as the bearer key when set), GUIDELLM (the command,
# default `python3 -m guidellm`). Writes OUT_DIR/guidellm.json (every request's timings) and prints guidellm's
# tables (TTFT, ITL, TPOT, output tok/s per concurrency), then one summary line per point.
#
# Offline on the GPU machine: bench/fetch_wheels.sh here (guidellm and what the GPU image lacks, 18 MiB),
# carry .whl/guidellm, then there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/guidellm .whl/guidellm/*.whl
#   GUIDELLM="env PYTHONPATH=/tmp/guidellm python3 -m guidellm" bench/outside_load.sh ...
set -euo pipefail
if [ $# -lt 2 ]; then sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
url=${1%/}; url=${url%/v1}; tokenizer=$2; out=${3:-out/guidellm}
[ -f "$tokenizer/tokenizer.json" ] || { echo "outside_load: no tokenizer.json in $tokenizer" >&2; exit 2; }
if [ "${SMOKE:-0}" = 1 ]; then
  : "${PROMPT_TOKENS:=64}" "${OUTPUT_TOKENS:=16}" "${SWEEP:=1,4}" "${REQUESTS:=8}" "${POINT_SECONDS:=60}"
fi
prompt=${PROMPT_TOKENS:-512}; output=${OUTPUT_TOKENS:-256}; sweep=${SWEEP:-1,8,32,64}
requests=${REQUESTS:-128}; seconds=${POINT_SECONDS:-60}; route=${ROUTE:-/v1/completions}; model=${MODEL:-eyrie}
key=""; [ -n "${EYRIE_API_KEY:-}" ] && key=",api_key=$EYRIE_API_KEY"
mkdir -p "$out"
# No network: the tokenizer is read from disk and nothing is looked up on a hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL=WARNING
echo "outside_load: guidellm -> $url$route, model $model, tokenizer $tokenizer, ${prompt}:${output} tokens," \
     "concurrency $sweep, at most $requests requests or ${seconds}s per point"
${GUIDELLM:-python3 -m guidellm} run \
  --backend "kind=openai_http,target=$url,model=$model,request_format=$route$key" \
  --profile "kind=concurrent,streams=${sweep%%,*}" --override profile.streams "$sweep" \
  --data "kind=synthetic_text,prompt_tokens=$prompt,output_tokens=$output" \
  --tokenizer "kind=hf_auto,model=$tokenizer" \
  --constraint "kind=max_requests,count=$requests" --constraint "kind=max_duration,seconds=$seconds" \
  --output "kind=json,path=$out/guidellm.json" --output kind=console --disable-progress
python3 - "$out/guidellm.json" <<'EOF'
import json, statistics, sys

def q(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))] if values else float("nan")

for b in json.load(open(sys.argv[1]))["benchmarks"]:
    ok = [r for r in b["requests"]["successful"]]
    ttft = [r["time_to_first_token_ms"] / 1e3 for r in ok if r.get("time_to_first_token_ms") is not None]
    itl = [r["inter_token_latency_ms"] / 1e3 for r in ok if r.get("inter_token_latency_ms") is not None]
    out_tokens = sum(r.get("output_tokens") or 0 for r in ok)
    totals = b["metrics"]["request_totals"]
    print(f"guidellm c{b['config']['strategy']['streams']}: {totals['successful']} ok, {totals['errored']} errored; "
          f"TTFT p50 {q(ttft, .5):.3f} s p99 {q(ttft, .99):.3f} s; ITL (each request's mean) p50 {q(itl, .5) * 1e3:.1f} ms "
          f"p99 {q(itl, .99) * 1e3:.1f} ms; output {out_tokens / b['duration']:.1f} tok/s over {b['duration']:.1f} s"
          + (f", mean TTFT {statistics.mean(ttft):.3f} s" if ttft else ""))
EOF
