#!/usr/bin/env bash
# The GPU checks and measurements that wait for a device, as stages that each fit one device call
# (at most 10 minutes). Run from the project root on the GPU machine; every stage writes its log and
# JSON under $OUT (default ./out/gpu), so a stage cut off by its time limit still leaves what it did.
#
#   bench/gpu_session.sh suite      # the whole GPU suite, one command: pytest tests/gpu tests/unit -m gpu
#   bench/gpu_session.sh router-cpu # bench_router.py (1 and 2 routers; gRPC, then OpenAI clients) on the GPU machine's cores
#   bench/gpu_session.sh batch-invariant  # batch_invariant's GPU tests, then its price on the decode step (~5 min)
#   SUITE_PART=1 bench/gpu_session.sh suite-x2   # two GPUs: half the one-GPU suite, both GPUs at once (then PART=2)
#   bench/gpu_session.sh hazards    # which events invalidate a CUDA graph capture (bench/capture_hazards.py)
#   bench/gpu_session.sh tests      # GPU tests: kernels at real shapes, graphs == eager == CPU, drafting ahead
#   bench/gpu_session.sh choices    # n=16 choices through the stack on the GPU: the target's law, choices independent
#   bench/gpu_session.sh extend     # extend attention: every candidate on every shape, the tuned table written
#   bench/gpu_session.sh fp8        # FP8 products and checkpoints on the GPU, then the 8B FP8 decode step vs its floor
#   bench/gpu_session.sh attn-lossless  # issue 34: attention's decode == verify bits (8B shape, bf16/fp32) and an FP8
#                                   # oracle's decode == verify logits, the FP8 greedy tests with and without a head,
#                                   # then the batch-1 decode step (1k, 8k) and verify (N 6, 16) before (the kernel
#                                   # of bench/baseline/) and after, one table (~5 min on one H100)
#   bench/gpu_session.sh fp8-split  # split-K for the small FP8 products (launches x splits), then the step without/with
#   bench/gpu_session.sh cross-check  # guidellm vs bench_serving's client on one stack (carry .whl with .whl/guidellm)
#   bench/gpu_session.sh fp8-tune   # the FP8 skinny GEMM's launch configurations at the 8B shapes, 1 and 8 rows,
#                                   # both tl.dot operand orders, and the bf16 LM head through the same launch
#   bench/gpu_session.sh fp8-profile  # the batch-1 decode step (bf16, FP8 channel and block) kernel by kernel
#   bench/gpu_session.sh decode     # EAGLE-3 iteration vs a decode step at batch 1, context 1k (drafting ahead)
#   bench/gpu_session.sh spec-grid  # every speculative phase, graph and eager, batch 1..64 x context 1k..8k
#   bench/gpu_session.sh attention  # paged decode / extend / verify attention vs copy bandwidth and SDPA
#   bench/gpu_session.sh serving    # the stack vs the single-process engine, 8B shape (bench/bench_serving.py)
#   bench/gpu_session.sh prefix     # the prefix cache on == off on the GPU, graphs and drafting ahead on (issue 33)
#   bench/gpu_session.sh prefix-route  # two prefill instances with a prefix cache, graphs on: follow-ups go to the
#                                   # one holding their prefix, cached tokens = matched, greedy == one engine (issue 33)
#   bench/gpu_session.sh decode-cache  # a decode instance's prefix cache on the GPU: a branch's hand-off sends only the
#                                   # page it lacks (ipc, grpc-stream), greedy == one engine; the hand-off GPU tests (issue 33)
#   bench/gpu_session.sh local      # c32 and c1, the stack with short prompts prefilled on the decode service, then without
#   bench/gpu_session.sh features   # a penalised EAGLE-3 iteration vs a plain one, batch 1 and 32 (bench_features.py)
#   bench/gpu_session.sh tp-tests   # two GPUs: TP-2 over NCCL == one GPU (graphs on/off), TP services, the second GPU,
#                                   # each test its own process and bound, stacks of every process at a bound
#                                   # (TP_DIAG="TEST BOUND;TEST BOUND": a chosen few; ~4 min for all)
#   bench/gpu_session.sh tp-cache   # two GPUs: a TP-2 decode engine's prefix cache over NCCL, graphs on: a hand-off
#                                   # takes the pages both ranks hold and is sent the rest, output/bytes/K/V == TP 1
#   bench/gpu_session.sh tp         # two GPUs: 8B decode step TP 1 vs TP 2 vs its floor, IPC into a peer GPU (bench_tp.py)
#   bench/gpu_session.sh dtype-auto # one GPU: dtype auto loads the bf16 widened pair (/tmp/wide) as bfloat16 (weights,
#                                   # head, pools: half fp32's bytes), == explicit bfloat16; fp16 kept, fp32 -> bf16
#   bench/gpu_session.sh memory     # one GPU: prefill + decode at 0.45 each, EAGLE-3, 8B shape: served, peaks within 0.45
#                                   # (services' logs in $OUT/memory-logs, their memory events in memory_events.log)
#   bench/gpu_session.sh layouts    # two GPUs: colo1, pd1, pd2, colo2 as users deploy them, 8B-shaped pair, one table, ~8 min
#                                   # (LAYOUT_TRANSPORT=grpc-stream: every layout's hand-off transport; default auto)
#   bench/gpu_session.sh pd2-arrivals  # two GPUs: pd2 quiet and with arrivals, a peer copy's wait on the device vs
#                                   # on the host (EYRIE_PEER_WAIT), ~8 min
#   bench/gpu_session.sh layouts4   # four GPUs: pd4 (1P3D) vs colo4, the same workloads and goodput, ~6 min
#   bench/gpu_session.sh peer       # two GPUs: peer hand-off tests, then a 4096-token 8B hand-off (target + EAGLE-3
#                                   # draft) into a peer GPU, every copy mode (staged per chunk size, pull, runs;
#                                   # push, runs-strided in their own process) per page layout vs cudaMemcpyPeer
#                                   # (bench_handoff.py --peer: peer.json, peer_push.json)
#   bench/gpu_session.sh nixl       # two GPUs: NIXL VRAM writes GPU 0 -> GPU 1 per UCX_TLS (bench_nixl.py; needs the
#                                   # nixl-cu13 wheel in .whl: ../shared/tools/gpu-wheels.sh nixl-cu13==1.5.1)
#   bench/gpu_session.sh policy     # one GPU, through the stack (OpenAI API): plain vs the defaults with a draft (adaptive)
#                                   # (POLICY_LAYOUT=colo1: no prefill instance, the decode instance prefills; default pd1)
#                                   # (POLICY_MPS=1: the services as clients of an MPS daemon; POLICY_DEADLINE_S,
#                                   # POLICY_SWEEP=32,64,128: the concurrencies)
#                                   # (POLICY_RUNS=plain,chain3,tree: the fixed shapes, a second call), c1..c128, the
#                                   # 8B-shaped widened pair, greedy checked equal (bench/house/policy_stack.py), ~9 min;
#                                   # "exit 1": a configuration or requests failed, "exit 3": only greedy left plain's
#   bench/gpu_session.sh mps-ab     # pd1 without, then with an MPS daemon, plain and the defaults, c32-c128, one machine
#   bench/gpu_session.sh graphs     # issue 30: colo1 c32/c64/c128 (max_running 128), graphs up to max_running (or as far
#                                   # as the memory fraction allows: graphs_*_memory.log); then GRAPH_CAP=32 ... graphs:
#                                   # the old cap of 32 (graphs_*.json with each fixed point's ideal, ~5 min each)
#   bench/gpu_session.sh prefix-bench   # issue 33: the shared-prefix benchmark, one GPU: colo1 and pd1, the prefix cache
#                                   # on and off, the widened pair with its EAGLE-3 head, OpenAI API: 16 prefixes x 10
#                                   # questions (2048 + 128 tokens, 256 out, c32), chat 16x4, the c1 TTFT probe
#                                   # (bench/bench_prefix.py: prefix_bench.json / .md, ~8 min)
#   bench/gpu_session.sh prefix-bench2  # the same on two GPUs for pd2 (1P1D), the issue's 64 prefixes x 10 questions
#   bench/gpu_session.sh profile    # issue 30: one engine in-process at c32/c64/c128, per step kind wall vs device time and
#                                   # a torch.profiler window (bench/profile_engine.py), with the EAGLE-3 head then without;
#                                   # PROFILE_C=128 PROFILE_ARGS="--prompt 256 --output 128": stop 47's c128 comparison
#                                   # PROFILE_REPEAT=2: the two engines alternated twice, medians and spreads compared
#   PROFILE_ALT=alt.tar.gz bench/gpu_session.sh profile-branch  # profile here, then its head run on another tree
#   bench/gpu_session.sh profile-host  # the same engine's host functions per step under cProfile at c64/c128
#   bench/gpu_session.sh syncs      # every synchronizing call of a c128 loop by site (bench/find_syncs.py), and the GPU
#                                   # test that the draft's work in a step never waits for the device
#   bench/gpu_session.sh launch     # Triton launches through kernels.launch.fast: its GPU test, the attention GPU tests,
#                                   # then host us per launch against JITFunction.run (bench/bench_launch.py, ~3 min)
#   bench/gpu_session.sh launch-ab  # one engine at c128, plain and EAGLE-3, launches fast vs JITFunction.run alternated
#   bench/gpu_session.sh mixed-graphs  # cuda_graph_mixed's GPU test, then c128 eager vs pieces (launch-ab's modes)
#   bench/gpu_session.sh profile-mixed # a torch.profiler window over c128's first-wave mixed steps, without and with
#                                   # the EAGLE-3 head (profile_mixed_{plain,adaptive}.json)
#   bench/gpu_session.sh split-attn # decode-like attention at the engine's graph bounds: serial vs every n'th split
#   bench/gpu_session.sh anatomy    # the kernels of padding steps per (kind, batch), from the captured graphs
#   bench/gpu_session.sh mixed-attn # issue 30: a mixed step's decode rows through the decode launch, chunks through the
#                                   # extend kernel: the bits (tests/gpu/test_mixed_attention_gpu.py), then one layer's
#                                   # attention before (whole batch through extend) vs after, in us (mixed_attention.json)
#   bench/gpu_session.sh receive    # a decode-step proxy on the last GPU while grpc-stream hand-offs arrive, the
#                                   # scatter before issue 28 beside the current one (bench_receive.py --legacy)
#
# Several stages in one call run in the order given. Python packages the GPU image lacks come from
# ./.whl (../shared/tools/gpu-wheels.sh on the CPU machine; carry .whl with the call). suite-x2 and tp-tests also
# need pytest-xdist, execnet and pytest-timeout there: `python -m pip download --no-deps -d .whl pytest-xdist
# execnet pytest-timeout` (pure-Python wheels, ~0.2 MiB).
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
# The wheels go in once per machine (a marker says so): two invocations may then run side by side (a CPU stage
# pinned to some cores beside a GPU stage) without one reinstalling under the other's running processes.
if compgen -G ".whl/*.whl" > /dev/null; then
  if [ ! -f /tmp/site/.eyrie-wheels ] || [ -n "$(find .whl -name '*.whl' -newer /tmp/site/.eyrie-wheels)" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.eyrie-wheels
  fi
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv > "$OUT/device.csv" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/device.csv"

run() {  # run NAME SECONDS COMMAND...: the command's output in $OUT/NAME.log, its exit status reported
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s: $*" | tee -a "$OUT/summary.txt"
  tail -n 3 "$OUT/$name.log"
}

for stage in "$@"; do
  case $stage in
    batch-invariant)  # the engine's batch_invariant: its GPU tests (a row's bits at every row count at the 8B
      # shapes; greedy with a draft == without at batch in bf16), then the batch-1/32 decode step and the EAGLE-3
      # iteration without and with it (its price). Through the stack: EYRIE_BATCH_INVARIANT=true ... policy
      run batch_invariant_tests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_batch_invariant_gpu.py
      for bi in off on; do
        run "batch_invariant_decode_$bi" 150 python3 bench/bench_decode.py --batches 1,32 --contexts 1024 \
          --draft eagle3 --verify-ns 8 $([ $bi = on ] && echo --batch-invariant) --out "$OUT/batch_invariant_$bi.json"
      done
      ;;
    router-cpu)  # issue 29 on the GPU machine's own cores (16+, none shared with the bench as on the 2-core CPU
      # machine): one router and two against synthetic instances with room for both, 256 and 512 streams
      # through the router's gRPC API, then the OpenAI API (streamed completions, as bench_serving's clients): the
      # capacity (8 instances of 10k tok/s each: the routers saturate), 1 router then 2; then the latency a router
      # adds at the issue's rate (8 x 2,500 = 20k tok/s offered over 512 streams)
      for api in grpc openai; do
        run "router_cpu_$api" 150 python3 bench/bench_router.py --api "$api" --streams 512 --routers 1,2 \
          --instances 8 --clients 4 --duration-s 10 --out "$OUT/router_cpu_$api.json"
        run "router_cpu_${api}_20k" 90 python3 bench/bench_router.py --api "$api" --streams 512 --routers 1 \
          --instances 8 --instance-tok-s 2500 --clients 4 --duration-s 10 --out "$OUT/router_cpu_${api}_20k.json"
      done
      ;;
    suite-x2)  # two GPUs: half the one-GPU suite (SUITE_PART=1 or 2: tests/gpu's files alternately, part 2 with
      # tests/unit -m gpu) on both GPUs at once, an xdist worker per GPU (EYRIE_GPU_PER_WORKER, tests/conftest.py);
      # -v streams each result into the log, so a call cut off still says what ran. The two-GPU tests: tp-tests.
      mapfile -t files < <(ls tests/gpu/test_*.py | sort)
      part=${SUITE_PART:-1}; sel=()
      for i in "${!files[@]}"; do [ $((i % 2 + 1)) = "$part" ] && sel+=("${files[$i]}"); done
      [ "$part" = 2 ] && sel+=(tests/unit)
      EYRIE_GPU_PER_WORKER=2 run "gpu_suite_x2_part$part" 560 python3 -m pytest -v -p no:cacheprovider -n 2 \
        --dist loadfile --timeout 300 --durations 30 -m gpu "${sel[@]}"
      ;;
    suite)
      run gpu_suite 540 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit -m gpu
      ;;
    hazards)
      run hazards 300 python3 bench/capture_hazards.py --out "$OUT/hazards.json"
      ;;
    tests)
      run gpu_tests 420 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "drafting_ahead or extend"
      run gpu_tests_rest 160 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not drafting_ahead and not extend"
      ;;
    choices)  # tests/e2e/test_choices_sampling.py's gpu case: 640 sampled choices under EAGLE-3 on cuda:0
      run choices 300 python3 -m pytest -q -s -p no:cacheprovider tests/e2e/test_choices_sampling.py -m gpu
      ;;
    kernels)
      run kernel_tests 570 python3 -m pytest -q -p no:cacheprovider tests/unit/kernels
      ;;
    extend)
      run extend 570 python3 bench/bench_extend.py --tune-shapes --write-table "$OUT/extend_configs.json" \
        --out "$OUT/extend_shapes.json"
      ;;
    fp8)
      run fp8_tests 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gpu.py tests/unit/kernels/test_fp8_gemv.py
      run fp8_bench 200 python3 bench/bench_fp8.py --scaled-mm --out "$OUT/fp8.json"
      ;;
    attn-lossless)
      run attn_lossless_tests 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_invariance_gpu.py
      run attn_lossless_greedy 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gpu.py \
        -k "greedy_is_the_same"
      OUT_ABS=$(cd "$OUT" && pwd)
      rm -rf /tmp/before && mkdir -p /tmp/before \
        && tar --exclude=./out --exclude=./.whl --exclude=./.git -cf - . | tar -xf - -C /tmp/before \
        && cp bench/baseline/attention_before_issue34.py /tmp/before/kernels/attention.py \
        && cp bench/baseline/forward_batch_before_issue34.py /tmp/before/shared/forward_batch.py
      run decode_before 140 bash -c "cd /tmp/before && PYTHONPATH=/tmp/before:${PYTHONPATH:-} python3 \
        bench/bench_decode.py --batches 1 --contexts 1024,8192 --verify-ns 6,16 --out $OUT_ABS/decode_before.json"
      run decode_after 140 python3 bench/bench_decode.py --batches 1 --contexts 1024,8192 --verify-ns 6,16 \
        --out "$OUT/decode_after.json"
      python3 bench/baseline/compare_decode.py "$OUT/decode_before.json" "$OUT/decode_after.json" \
        | tee "$OUT/decode_before_after.txt"
      ;;
    fp8-split)  # issue 34: split-K for the small FP8 products: a few launches x splits 1, 2, 4, 8 at 1 and 8 rows,
      # then the batch-1 decode step without split-K (EYRIE_FP8_SPLIT=1) and with the default (auto), one machine
      run fp8_split_tune 300 python3 bench/bench_fp8_gemv.py --splits 1,2,4,8 --rows 1,8 --formats channel,block \
        --out "$OUT/fp8_split_gemv.json"
      EYRIE_FP8_SPLIT=1 run fp8_step_nosplit 150 python3 bench/bench_fp8.py --skip-greedy --formats bf16,channel,block \
        --out "$OUT/fp8_step_nosplit.json"
      run fp8_step_split 150 python3 bench/bench_fp8.py --skip-greedy --formats bf16,channel,block \
        --out "$OUT/fp8_step_split.json"
      grep -h "step\|floor" "$OUT"/fp8_step_*.log | head -20
      ;;
    cross-check)  # issue 34: guidellm against bench_serving's client on one plain stack of the widened pair, OpenAI
      # API, 512:256 (bench/cross_check.py); guidellm's wheels from bench/fetch_wheels.sh in .whl/guidellm (~6 min)
      [ -f /tmp/wide/target/config.json ] || run widen 300 python3 -m bench.house.widen_tiny --out /tmp/wide
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/guidellm .whl/guidellm/*.whl
      run cross_check 520 python3 bench/cross_check.py --model /tmp/wide/target --device cuda --dtype bfloat16 \
        --prompt 512 --output 256 --sweep "${CROSS_SWEEP:-1,8,32,64}" --requests "${CROSS_REQUESTS:-32}" \
        --point-seconds 40 --guidellm "env PYTHONPATH=/tmp/guidellm python3 -m guidellm" --workdir /tmp/cross \
        --out "$OUT/cross_check.json"
      tail -n 30 "$OUT/cross_check.log"
      ;;
    fp8-tune)
      run fp8_tune 570 python3 bench/bench_fp8_gemv.py --tune --out "$OUT/fp8_gemv.json"
      ;;
    fp8-profile)  # the batch-1 decode step, bf16 and FP8, kernel by kernel; then FP8 with the weight tile the dot's
      # left operand (the order before 2026-12-07), for comparison
      run fp8_profile 300 python3 bench/bench_fp8.py --profile --skip-greedy --out "$OUT/fp8_profile.json"
      EYRIE_FP8_DOT=wx run fp8_profile_wx 200 python3 bench/bench_fp8.py --profile --skip-greedy \
        --formats channel --out "$OUT/fp8_profile_wx.json"
      ;;
    decode)
      run decode 570 python3 bench/bench_decode.py --batches 1 --contexts 1024 --draft eagle3 --verify-ns 8 \
        --out "$OUT/spec_eagle3.json"
      ;;
    features)
      run features 570 python3 bench/bench_features.py --out "$OUT/features.json"
      ;;
    spec-grid)
      run spec_grid 570 python3 bench/bench_decode.py --skip-decode --batches 1,8,32,64 --contexts 1024,4096,8192 \
        --draft eagle3 --verify-ns 8 --spec-grid --out "$OUT/spec_grid.json"
      ;;
    attention)
      run attention 570 python3 bench/bench_attention.py --quick --out "$OUT/attention.json"
      ;;
    tp-tests|tp-diag)  # the TP GPU tests one at a time, each with its own bound; at the bound every Python process of the
      # test (pytest and its spawned ranks, PYTHONFAULTHANDLER) prints its threads' stacks into the log, then ends
      S=tests/gpu/test_tensor_parallel_stack_gpu.py::test_a_tp2_service_over_nccl_in_the_stack_gives_one_gpus_greedy_output
      DIAG=(); [ -n "${TP_DIAG:-}" ] && IFS=';' read -ra DIAG <<< "$TP_DIAG"  # "test bound;test bound;..."
      [ ${#DIAG[@]} -gt 0 ] || DIAG=("$S[tp2-decode-grpc-stream] 130" "tests/gpu/test_tensor_parallel_gpu.py::test_tp2_over_nccl_equals_one_gpu[True] 150"  \
                 "$S[tp2-prefill-ipc] 110" "tests/gpu/test_tensor_parallel_gpu.py -k prefix_cache 100"  \
                 "tests/gpu/test_tensor_parallel_load_gpu.py 30"  \
                 "tests/gpu/test_graphs_gpu.py::test_an_engine_on_the_second_gpu_stepped_from_another_thread 50"  \
                 "tests/gpu/test_tensor_parallel_gpu.py::test_collectives_captured_in_a_cuda_graph_replay_on_new_inputs 30"  \
                 "tests/gpu/test_tensor_parallel_gpu.py::test_tp2_over_nccl_equals_one_gpu[False] 60")
      k=0
      for t in "${DIAG[@]}"; do
        set -- $t
        secs=${!#}; args=("${@:1:$#-1}")
        k=$((k + 1)); name=tp_diag_${k}_$(echo "${args[*]}" | sed 's/.*:://; s/[^A-Za-z0-9]/_/g' | cut -c1-40)
        ( sleep $((secs - 15)); pkill -ABRT -f spawn_main; sleep 3; pkill -ABRT -f "pytest.*$(basename "${1%%::*}")" ) &
        watcher=$!
        PYTHONFAULTHANDLER=1 run "$name" "$secs" python3 -m pytest -q -s -p no:cacheprovider -rA "${args[@]}"
        kill $watcher 2>/dev/null; pkill -9 -f spawn_main; sleep 1
      done
      ;;
    tp-cache)  # issue 33 under TP: tests/gpu/test_tensor_parallel_gpu.py's prefix-cache hand-offs (wire, ipc)
      run tp_cache 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py -k prefix_cache
      ;;
    tp)
      run bench_tp 450 python3 bench/bench_tp.py --out "$OUT/tp.json"
      ;;
    peer)
      # push and runs-strided store into the peer's IPC mapping from a kernel on the source GPU: their test and
      # bench rows run in processes of their own (an unmapped store would spoil the CUDA context beside it).
      run peer_tests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_peer_handoff_gpu.py
      run bench_peer 240 python3 bench/bench_handoff.py --peer --repeat 10 --json "$OUT/peer.json"
      run peer_push_test 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_peer_push_gpu.py
      run bench_peer_push 120 python3 bench/bench_handoff.py --peer --peer-modes runs-strided,push --repeat 10 \
        --json "$OUT/peer_push.json"
      cat "$OUT/bench_peer.log" "$OUT/bench_peer_push.log"
      ;;
    nixl)
      run bench_nixl 500 python3 bench/bench_nixl.py --mb 512 --descs 1,2112 --mem VRAM --reader-gpu 1 --timeout 50 \
        --tls "default;cuda_ipc,cuda_copy,tcp;cuda_ipc,cuda_copy;cuda_copy,tcp" --json "$OUT/nixl.json"
      ;;
    policy)  # the widened pair in memory when /dev/shm has room (four stacks load it twice each)
      shm_kb=$(df -k --output=avail /dev/shm 2>/dev/null | tail -n 1)
      work=/tmp/eyrie-policy
      [[ ${shm_kb:-0} =~ ^[0-9]+$ && ${shm_kb:-0} -gt $((40 << 20)) ]] && work=/dev/shm/eyrie-policy
      # POLICY_MPS=1: an MPS control daemon first, every service its client (the two processes of pd1 then run
      # kernels side by side on the GPU instead of in time slices); stopped after the run
      if [ "${POLICY_MPS:-0}" = 1 ]; then
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        nvidia-cuda-mps-control -d && echo "policy: MPS control daemon started" | tee -a "$OUT/summary.txt"
      fi
      # All four stacks do not fit one call's 10 minutes (the adaptive one's start alone took 93 s on an H100):
      # POLICY_RUNS=plain,default then POLICY_RUNS=plain,chain3,tree, one call each
      PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 run policy 560 python3 -m bench.house.policy_stack \
        --out "$OUT" --work "$work" --runs "${POLICY_RUNS:-plain,default}" --layout "${POLICY_LAYOUT:-pd1}" \
        --deadline-s "${POLICY_DEADLINE_S:-500}" ${POLICY_SWEEP:+--sweep "$POLICY_SWEEP"}
      if [ "${POLICY_MPS:-0}" = 1 ]; then
        echo quit | nvidia-cuda-mps-control; cp "$CUDA_MPS_LOG_DIRECTORY"/control.log "$OUT/mps_control.log" 2>/dev/null
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
      fi
      for d in "$work"/logs-*; do
        [ -d "$d" ] && mkdir -p "$OUT/$(basename "$d")" && cp "$d"/*.log "$OUT/$(basename "$d")/"
      done
      cat "$OUT/policy.log" | tail -n 12
      rm -rf "$work"
      ;;
    mps-ab)  # pd1 with and without an MPS daemon, one machine: plain and the defaults at c32, c64, c128 (~7 min)
      for mps in 0 1; do
        OUT="$OUT/mps$mps" POLICY_MPS=$mps POLICY_RUNS=${POLICY_RUNS:-plain,default} POLICY_SWEEP=${POLICY_SWEEP:-32,64,128} \
          POLICY_DEADLINE_S=${POLICY_DEADLINE_S:-200} bash "$0" policy
      done
      ;;
    mixed-attn)
      run mixed_attn_tests 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mixed_attention_gpu.py \
        "tests/gpu/test_extend_attention_gpu.py::test_engine_prefill_through_the_extend_kernel_equals_paged_and_cpu"
      run mixed_attn_bench 300 python3 bench/bench_mixed_attention.py --out "$OUT/mixed_attention.json"
      cat "$OUT/mixed_attn_bench.log"
      ;;
    receive)
      last=$(( $(nvidia-smi -L | wc -l) - 1 ))
      run bench_receive 240 python3 bench/bench_receive.py --device "cuda:$last" --tokens 512 --seconds 20 --legacy \
        --json "$OUT/receive.json"
      ;;
    local)  # conditional disaggregation (short prompts prefilled on the decode service) vs the engine, then without
      run serving_local 420 python3 bench/bench_serving.py --workdir /tmp/serving --workloads fixed --sweep 32,1 \
        --apis grpc --waves 4 --local-prefill 1024,0 --deadline-s 400 --out "$OUT/serving_local.json"
      cp -r /tmp/serving/logs-* /tmp/serving/engine.log "$OUT/" 2>/dev/null
      ;;
    prefix)  # the prefix cache on == off with CUDA graphs and drafting ahead (tests/gpu/test_prefix_cache_gpu.py)
      run prefix_cache 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_prefix_cache_gpu.py
      ;;
    decode-cache)  # the decode instance's prefix cache: hand-offs send only the pages it lacks, on the GPU
      run decode_cache 300 python3 -m pytest -q -p no:cacheprovider tests/unit/handoff/test_handoff_gpu.py \
        -k "decode_cache or services_on_cuda or cuda_engines"
      ;;
    prefix-route)  # prefix-aware placement through the stack on the GPU (tests/gpu/test_prefix_routing_gpu.py)
      run prefix_route 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_prefix_routing_gpu.py
      ;;
    serving)
      run serving 575 python3 bench/bench_serving.py --workdir /tmp/serving --out "$OUT/serving.json"
      cp -r /tmp/serving/logs-* /tmp/serving/engine.log "$OUT/" 2>/dev/null
      ;;
    dtype-auto)  # the widened pair once (/tmp/wide, written in bf16), then tests/gpu/test_dtype_auto_gpu.py on it
      [ -f /tmp/wide/target/config.json ] || run widen 300 python3 -m bench.house.widen_tiny --out /tmp/wide
      EYRIE_WIDE_PAIR=/tmp/wide run dtype_auto 420 python3 -m pytest -q -s -p no:cacheprovider \
        tests/gpu/test_dtype_auto_gpu.py
      ;;
    memory)  # the widened pair once (/tmp/wide), then tests/gpu/test_memory_promise_gpu.py on it
      [ -f /tmp/wide/target/config.json ] || run widen 300 python3 -m bench.house.widen_tiny --out /tmp/wide
      EYRIE_WIDE_PAIR=/tmp/wide EYRIE_SERVICE_LOGS="$OUT/memory-logs" run memory 540 python3 -m pytest -q -s \
        -p no:cacheprovider tests/gpu/test_memory_promise_gpu.py
      cp /tmp/wide/widen.json "$OUT/" 2>/dev/null
      grep -HE 'gpu_memory|warmup|capture_failed|graphs_captured|eyrie: error|Error' \
        "$OUT"/memory-logs/*/*.log 2>/dev/null | cut -c1-2000 > "$OUT/memory_events.log"
      ;;
    layouts|layouts4)  # the layouts as users deploy them, the widened pair built once (/tmp/wide), one table
      [ -f /tmp/wide/target/config.json ] || run widen 300 python3 -m bench.house.widen_tiny --out /tmp/wide
      if [ "$stage" = layouts ]; then which=colo1,pd1,pd2,colo2 deadline=420; else which=pd4,colo4 deadline=300; fi
      run "$stage" $((deadline + 30)) python3 bench/bench_serving.py --layouts "$which" \
        --model /tmp/wide/target --draft /tmp/wide/eagle3 --prompts-file /tmp/wide/heldout.jsonl \
        --workdir "/tmp/$stage" --deadline-s "$deadline" --mixed-seconds 10 --point-seconds 15 --request-timeout-s 90 \
        --transports "${LAYOUT_TRANSPORT:-auto}" --out "$OUT/$stage.json"
      for d in /tmp/"$stage"/logs-*; do  # every layout's service logs, a failed start's included
        [ -d "$d" ] && mkdir -p "$OUT/$(basename "$d")" && cp "$d"/*.log "$OUT/$(basename "$d")/"
      done
      cat "$OUT/$stage.md" 2>/dev/null
      ;;
    pd2-arrivals)  # issue 28: pd2's 32 streams quiet and while 2048-token prompts arrive (bench_serving's mixed
      # workload), the copy into the peer GPU waiting on the device (the old way: a stream of the prefill process
      # blocked on the decode GPU) against on the host (EYRIE_PEER_WAIT, shared/handoff/ipc.py); fixed chain of 3
      [ -f /tmp/wide/target/config.json ] || run widen 300 python3 -m bench.house.widen_tiny --out /tmp/wide
      for wait in device host; do
        EYRIE_PEER_WAIT=$wait run "pd2_arrivals_$wait" 250 python3 bench/bench_serving.py --layouts pd2 \
          --model /tmp/wide/target --draft /tmp/wide/eagle3 --prompts-file /tmp/wide/heldout.jsonl \
          --workdir "/tmp/pd2_$wait" --sweep 32 --point-seconds 10 --mixed-seconds 10 --deadline-s 220 \
          --request-timeout-s 90 --spec-policy fixed --out "$OUT/pd2_arrivals_$wait.json"
        [ -d "/tmp/pd2_$wait/logs-pd2" ] && cp -r "/tmp/pd2_$wait/logs-pd2" "$OUT/logs_pd2_$wait"
        cat "$OUT/pd2_arrivals_$wait.md" 2>/dev/null
      done
      ;;
    prefix-bench|prefix-bench2)  # issue 33's benchmark, the widened pair built once (/tmp/wide), one table
      [ -f /tmp/wide/target/config.json ] || run widen 300 python3 -m bench.house.widen_tiny --out /tmp/wide
      if [ "$stage" = prefix-bench ]; then which=colo1,pd1 prefixes=16; else which=pd2 prefixes=64; fi
      which=${PREFIX_LAYOUTS:-$which}  # e.g. PREFIX_LAYOUTS=colo1: one layout, the whole deadline its own
      # What the widening (and the stages before) took of this call's 10 minutes is taken off the deadline:
      # the benchmark stops issuing by it, its last requests drain and its services stop within the 45 s after.
      deadline=$(( 520 - SECONDS )); [ "$deadline" -gt 460 ] && deadline=460; [ "$deadline" -lt 60 ] && deadline=60
      name=${stage//-/_}
      # PREFIX_LOCAL=256: the router's conditional disaggregation (a prompt with at most 256 tokens to compute past
      # the prefix its decode instance holds is prefilled there); PREFIX_CACHE=on: the cache-on runs alone
      run "$name" $((deadline + 45)) python3 bench/bench_prefix.py --layouts "$which" \
        --model /tmp/wide/target --draft /tmp/wide/eagle3 --prompts-file /tmp/wide/heldout.jsonl \
        --prefixes "$prefixes" --questions 10 --workdir "/tmp/$name" --deadline-s "$deadline" \
        --request-timeout-s 120 --local-prefill "${PREFIX_LOCAL:-0}" --cache "${PREFIX_CACHE:-on,off}" \
        --out "$OUT/$name.json"
      for d in /tmp/"$name"/logs-*; do  # every run's service logs, a failed start's included
        [ -d "$d" ] && mkdir -p "$OUT/$(basename "$d")" && cp "$d"/*.log "$OUT/$(basename "$d")/"
      done
      cat "$OUT/$name.md" 2>/dev/null
      ;;
    graphs)  # issue 30: one engine prefilling its own prompts (colo1), c32/c64/c128 at max_running 128, the graphs
      # covering every batch (the default) or capped (GRAPH_CAP=32: the old fixed cap); run both on one warm machine
      [ -f /tmp/wide/target/config.json ] || run widen 300 python3 -m bench.house.widen_tiny --out /tmp/wide
      cap=${GRAPH_CAP:-max_running}
      [ -n "${GRAPH_CAP:-}" ] && export EYRIE_CUDA_GRAPH_MAX_BS=$GRAPH_CAP
      run "graphs_$cap" 540 python3 bench/bench_serving.py --layouts colo1 \
        --model /tmp/wide/target --draft /tmp/wide/eagle3 --prompts-file /tmp/wide/heldout.jsonl \
        --workdir "/tmp/graphs_$cap" --max-running 128 --sweep 32,64,128 --deadline-s 480 --mixed-seconds 10 \
        --point-seconds 40 --request-timeout-s 90 --out "$OUT/graphs_$cap.json"
      grep -h "gpu_memory\|graphs_captured\|graphs_capped" "/tmp/graphs_$cap"/logs-*/*.log | cut -c1-1500 \
        > "$OUT/graphs_${cap}_memory.log"
      cat "$OUT/graphs_$cap.md" 2>/dev/null
      unset EYRIE_CUDA_GRAPH_MAX_BS
      ;;
    profile)  # issue 30 item 1: where one engine's time goes at c32/c64/c128 (in-process, the widened pair, graphs):
      # per step kind wall vs device time, a torch.profiler window's kernel time; the default (adaptive) then no draft
      [ -f /tmp/wide/target/config.json ] || run widen 300 python3 -m bench.house.widen_tiny --out /tmp/wide
      # PROFILE_ARGS: more flags for both runs, e.g. "--prompt 256 --output 128" (the policy stage's colo1 workload);
      # PROFILE_REPEAT=N: the two engines alternated N times (profile_{adaptive,plain}_rK.json), then
      # bench/profile_compare.py's medians and spreads (one run of each says little: machines and moments differ)
      reps=${PROFILE_REPEAT:-1}
      for k in $(seq "$reps"); do
        sfx=$([ "$reps" -gt 1 ] && echo "_r$k")
        run profile_adaptive$sfx 280 python3 bench/profile_engine.py --model /tmp/wide/target \
          --draft /tmp/wide/eagle3 --prompts-file /tmp/wide/heldout.jsonl --concurrency ${PROFILE_C:-32,64,128} \
          ${PROFILE_ARGS:-} --out "$OUT/profile_adaptive$sfx.json"
        [ "${PROFILE_PLAIN:-1}" = 0 ] || run profile_plain$sfx 240 python3 bench/profile_engine.py \
          --model /tmp/wide/target --prompts-file /tmp/wide/heldout.jsonl --concurrency ${PROFILE_C:-32,64,128} \
          ${PROFILE_ARGS:-} --out "$OUT/profile_plain$sfx.json"
      done
      cat "$OUT"/profile_adaptive*.log "$OUT"/profile_plain*.log | grep -v Warning | head -120
      [ "${PROFILE_PLAIN:-1}" = 0 ] || python3 bench/profile_compare.py plain="$OUT/profile_plain*.json" \
        adaptive="$OUT/profile_adaptive*.json" --out "$OUT/profile_compare.json"
      ;;
    profile-branch)  # the profile stage's head run on another tree beside this one's, one machine: PROFILE_ALT names a
      # `git archive --format=tar.gz` of it in this tree (untracked, not ignored: it travels), e.g.
      # `git archive --format=tar.gz -o alt.tar.gz wip/draft-extend-before-wait`; PROFILE_C / PROFILE_ARGS as profile's
      [ -f "${PROFILE_ALT:-}" ] || { echo "profile-branch: PROFILE_ALT must name a tar.gz of the other tree" >&2; exit 2; }
      PROFILE_PLAIN=${PROFILE_PLAIN:-1} bash "$0" profile
      rm -rf /tmp/alt && mkdir -p /tmp/alt/.whl && tar xzf "$PROFILE_ALT" -C /tmp/alt && cp .whl/*.whl /tmp/alt/.whl/
      (cd /tmp/alt && OUT="$OUT/alt" PYTHONPATH="/tmp/site:/tmp/alt" PROFILE_PLAIN=0 bash bench/gpu_session.sh profile)
      ;;
    profile-mixed)  # issue 30: a torch.profiler window over the first wave's mixed steps (a 512-token chunk beside the
      # decode rows) at c128, the target alone then with the EAGLE-3 head: where a chunk's 25-50 ms go; the engine's
      # phases apart (--annotate: the draft's extend, catch-up, the target's step); PROFILE_ARGS: more flags
      [ -f /tmp/wide/target/config.json ] || run widen 300 python3 -m bench.house.widen_tiny --out /tmp/wide
      run profile_mixed_plain 150 python3 bench/profile_engine.py --model /tmp/wide/target \
        --prompts-file /tmp/wide/heldout.jsonl --concurrency 128 --profile-after=-100 --profile-steps 30 --annotate \
        ${PROFILE_ARGS:-} --out "$OUT/profile_mixed_plain.json"
      run profile_mixed_adaptive 280 python3 bench/profile_engine.py --model /tmp/wide/target \
        --draft /tmp/wide/eagle3 --prompts-file /tmp/wide/heldout.jsonl --concurrency 128 --profile-after=-100 \
        --profile-steps 30 --annotate ${PROFILE_ARGS:-} --out "$OUT/profile_mixed_adaptive.json"
      for f in "$OUT"/profile_mixed_*.json; do
        python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['points'][0]['profile_window']; print(sys.argv[1], \
          w.get('steps'), w.get('wall_ms'), w.get('kernel_ms')); [print('  ', r['calls'], r['ms'], r['name'][:80]) \
          for r in w.get('top_kernels', [])[:16]]; [print('   range', k, v) for k, v in w.get('ranges', {}).items()]" "$f"
      done
      ;;
    profile-host)  # issue 30 item 2: the host functions per step of one engine (cProfile), EAGLE-3 adaptive, c64/c128
      [ -f /tmp/wide/target/config.json ] || run widen 300 python3 -m bench.house.widen_tiny --out /tmp/wide
      run profile_host 300 python3 bench/profile_engine.py --model /tmp/wide/target --draft /tmp/wide/eagle3 \
        --prompts-file /tmp/wide/heldout.jsonl --concurrency 64,128 --cprofile --profile-steps 30 \
        --out "$OUT/profile_host.json"
      grep -v Warning "$OUT/profile_host.log" | head -120
      ;;
    split-attn)  # issue 30: decode-like attention at the engine's graph bounds, serial vs every n'th split, bits checked;
      # then the attention kernels' GPU tests (decode == verify rows, any split, sliding window)
      run split_attn 240 python3 bench/bench_split_attention.py --out "$OUT/split_attn.json"
      # a long prompt's row among short ones (issue 28's arrivals: one 2080-key row beside 640-key streams)
      run split_attn_tails 120 python3 bench/bench_split_attention.py --contexts "" --tails 640:2080:33,40,64 \
        --programs 2,4 --out "$OUT/split_attn_tails.json"
      run attn_gpu_tests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
        tests/gpu/test_attention_invariance_gpu.py tests/gpu/test_sliding_window_gpu.py
      ;;
    anatomy)  # issue 30/31: the kernels of padding steps per (kind, batch) from the captured graphs (step_anatomy.py)
      [ -f /tmp/wide/target/config.json ] || run widen 300 python3 -m bench.house.widen_tiny --out /tmp/wide
      run anatomy 300 python3 bench/step_anatomy.py --model /tmp/wide/target --draft /tmp/wide/eagle3 \
        --cases "${ANATOMY_CASES:-plain/16,plain/32,plain/64,chain1/16,chain1/32,chain1/64,chain3/16,chain3/32}" \
        --out "$OUT/anatomy.json"
      grep -v Warning "$OUT/anatomy.log" | head -150
      ;;
    launch)  # issue 30: Triton launches through kernels.launch.fast: its GPU test, the attention kernels' GPU tests
      # (plan caching), the warm-launch test, then host us per launch, fast vs JITFunction.run (launch.json)
      run launch_tests 360 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fast_launch_gpu.py \
        tests/gpu/test_kernels_gpu.py tests/gpu/test_extend_attention_gpu.py tests/gpu/test_mixed_attention_gpu.py \
        tests/gpu/test_attention_invariance_gpu.py tests/gpu/test_warm_launches_gpu.py
      run launch_bench 120 python3 bench/bench_launch.py --out "$OUT/launch.json"
      cat "$OUT/launch_bench.log"
      ;;
    launch-ab)  # issue 30: one engine at c128 (256:128, in-process), Triton's launches through kernels.launch.fast and
      # through JITFunction.run (EYRIE_FAST_LAUNCH=0), alternated LAUNCH_REPEAT times (default 1), plain then the
      # EAGLE-3 default; bench/profile_compare.py's medians (profile_{plain,adaptive}_{fast,jit}_rK.json)
      [ -f /tmp/wide/target/config.json ] || run widen 300 python3 -m bench.house.widen_tiny --out /tmp/wide
      # LAUNCH_MODES: any of jit (EYRIE_FAST_LAUNCH=0), fast, pieces (fast + cuda_graph_mixed); default "jit fast"
      modes=${LAUNCH_MODES:-jit fast}
      for k in $(seq "${LAUNCH_REPEAT:-1}"); do
        for mode in $modes; do
          flag=$([ $mode = jit ] && echo 0 || echo 1)
          for eng in plain adaptive; do
            EYRIE_FAST_LAUNCH=$flag run profile_${eng}_${mode}_r$k 200 python3 bench/profile_engine.py \
              --model /tmp/wide/target $([ $eng = adaptive ] && echo --draft /tmp/wide/eagle3) \
              $([ $mode = pieces ] && echo --mixed-graphs) \
              --prompts-file /tmp/wide/heldout.jsonl --concurrency ${LAUNCH_C:-128} --prompt 256 --output 128 \
              --out "$OUT/profile_${eng}_${mode}_r$k.json"
          done
        done
      done
      labels=()
      for eng in plain adaptive; do for mode in $modes; do labels+=("${eng}_$mode=$OUT/profile_${eng}_${mode}_r*.json"); done; done
      python3 bench/profile_compare.py "${labels[@]}" --out "$OUT/launch_ab.json"
      ;;
    mixed-graphs)  # issue 30: steps with prefill chunks in CUDA graph pieces (cuda_graph_mixed): the GPU tests, then
      # c128 in-process, eager vs pieces (launches fast in both), alternated LAUNCH_REPEAT times
      run mixed_graphs_tests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mixed_graphs_gpu.py \
        tests/gpu/test_fast_launch_gpu.py
      LAUNCH_MODES="fast pieces" bash "$0" launch-ab
      ;;
    syncs)  # issues 30/31: every synchronizing call of one engine's c128 loop by site (bench/find_syncs.py), the
      # widened pair with its EAGLE-3 head, then the GPU test that the draft's work in a step never waits (~3 min)
      [ -f /tmp/wide/target/config.json ] || run widen 300 python3 -m bench.house.widen_tiny --out /tmp/wide
      run host_syncs_test 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_host_syncs_gpu.py
      run find_syncs 300 python3 bench/find_syncs.py --model /tmp/wide/target --draft /tmp/wide/eagle3 \
        --prompts-file /tmp/wide/heldout.jsonl --concurrency ${SYNCS_C:-128} --prompt 256 --output 128 \
        --out "$OUT/find_syncs.json"
      grep -v Warning "$OUT/find_syncs.log" | head -40
      ;;
    *)
      echo "unknown stage $stage (suite, hazards, tests, kernels, extend, decode, spec-grid, attention, serving," \
        "features, tp-tests, tp, local, memory, layouts, layouts4, peer, nixl, receive, policy, graphs," \
        "prefix, prefix-route, decode-cache, prefix-bench, prefix-bench2, profile, profile-branch, profile-host," \
        "profile-mixed, split-attn, anatomy, mixed-attn, batch-invariant, suite-x2, tp-diag, router-cpu," \
        "pd2-arrivals, fp8, fp8-split, fp8-tune, fp8-profile, cross-check, syncs, launch, launch-ab," \
        "mixed-graphs)" >&2
      exit 2
      ;;
  esac
done
