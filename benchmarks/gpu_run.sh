#!/usr/bin/env bash
# One GPU run: environment, GPU tests, benchmarks, sanitizer; everything lands in $OUT.
# Usage (on the GPU machine, from the repository root): bash benchmarks/gpu_run.sh [parts]
# parts: any of env gpu-tests staging decode-rows tests ensure ensure-repeat markov-cost copy sanitize moe formats formats-engine router routed overlap resident engine
# qwen3-next decode-qwen3-next gpt-oss decode-gpt-oss glm decode-glm mixtral-olmoe decode-mixtral decode-olmoe decode-trace-mixtral decode decode-formats decode-trace step prefill hybrid hybrid-step sanitize-hybrid decode-hybrid decode-hybrid-trace mma mma-bench agent long-context agent-soak agent-soak-start agent-soak-wait peer-setup peer-wait peer-build peer-convert peer-llama peer-ours peer-report (default: env tests ensure copy sanitize moe routed overlap; the others by name). Wheels for
# packages the image lacks (flashlib) are read from .whl/ when present. The device tool brings
# back at most 8 files from $OUT: run a few parts per call (overlap alone writes 5).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
parts=${*:-env tests ensure copy sanitize moe routed overlap}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for part in $parts; do
  case $part in
    env)
      # the host beside the card: its CPU as lscpu and numba's LLVM see it (the CPU experts' code is built for it)
      { nvidia-smi; python3 -c "import torch, triton, numba, numpy; print(torch.__version__, triton.__version__, numba.__version__, numpy.__version__, torch.cuda.get_device_name())"
        lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|L3)"
        python3 -c "import llvmlite.binding as ll; print('LLVM host CPU', ll.get_host_cpu_name())"
        echo "commit ${EXPERTCACHE_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; } > "$OUT/env.txt" 2>&1
      tail -3 "$OUT/env.txt" ;;
    gpu-tests)
      # every gpu test but the HTTP server's (the image has no FastAPI): the cache, the kernels, the layer,
      # the formats, the engine of every family; compiles dominate, spread over GPU_TEST_WORKERS processes
      if [ -d .traces ]; then export EXPERTCACHE_TRACES=$PWD/.traces; fi
      timeout -s INT -k 20 ${GPU_TESTS_TIMEOUT:-560} python3 -m pytest -q -rfE -p no:cacheprovider -n "${GPU_TEST_WORKERS:-14}" -m gpu \
        tests/expertcache tests/moe/kernels tests/moe/model tests/moe/engine tests/moe/serve/test_scheduler.py \
        2>&1 | tee "$OUT/gpu-tests-all.log" | tail -15 ;;
    staging)
      # prefill's staging ring and grouped decode on the real copy stream and events: the file is not marked
      # gpu (on the CPU it stands in no-op streams) and runs on CUDA where there is one
      timeout -s INT -k 20 ${STAGING_TIMEOUT:-300} python3 -m pytest -q -rfE -p no:cacheprovider -n "${GPU_TEST_WORKERS:-8}" \
        tests/moe/engine/test_prefill_staging.py 2>&1 | tee "$OUT/gpu-tests-staging.log" | tail -4 ;;
    decode-rows)
      # prefill's group decode kernel at the real shapes, and every family's engine with quantized experts
      # (prefill through the kernel) against transformers on the decoded experts
      timeout -s INT -k 20 ${DECODE_ROWS_TIMEOUT:-240} python3 -m pytest -q -rfE -p no:cacheprovider -n "${GPU_TEST_WORKERS:-14}" \
        -m gpu tests/moe/kernels/test_decode_rows.py tests/moe/engine/test_engine_gpu.py -k "decode or quantized_experts" \
        2>&1 | tee "$OUT/gpu-tests-decode.log" | tail -4 ;;
    tests)
      # the real traces, when a git-ignored copy was carried along as .traces/
      if [ -d .traces ]; then export EXPERTCACHE_TRACES=$PWD/.traces; fi
      # Triton compiles dominate: spread the tests over GPU_TEST_WORKERS processes (pytest-xdist)
      timeout -s INT -k 20 ${TESTS_TIMEOUT:-420} python3 -m pytest -q -rfE -x -p no:cacheprovider -n "${GPU_TEST_WORKERS:-8}" tests/expertcache \
        -k "${TESTS_K:-device or copy or pool}" 2>&1 | tee "$OUT/gpu-tests.log" | tail -15 ;;
    ensure)
      timeout ${ENSURE_TIMEOUT:-400} python3 benchmarks/bench_ensure.py ${ENSURE_ARGS:-} --out "$OUT/ensure.json" 2>&1 | tee "$OUT/ensure.log" | tail -22 ;;
    ensure-repeat)
      # the device ensure's GPU tests, then its repeat test (a call rerun from the same saved state must give
      # the same state) at REPEAT_CALLS calls for every policy in REPEAT_PROCS processes at once: a shared GPU
      # is where a nondeterministic kernel showed (benchmarks/results/ensure-determinism-x8.log)
      timeout -s INT -k 20 ${ENSURE_TESTS_TIMEOUT:-240} python3 -m pytest -q -rfE -p no:cacheprovider -n 8 -m gpu \
        tests/expertcache/test_device_ensure_gpu.py 2>&1 | tee "$OUT/gpu-tests-ensure.log" | tail -3
      for i in $(seq 1 ${REPEAT_PROCS:-8}); do
        ( timeout ${REPEAT_TIMEOUT:-200} python3 -c "
import tests.expertcache.test_device_ensure_gpu as t
t.CALLS = ${REPEAT_CALLS:-120}
for p in t.device_policy_names():
    t.test_a_call_repeated_from_the_same_state_gives_the_same_state(p); print('ok', p)
" > "/tmp/repeat-$i.log" 2>&1; echo "exit $?" >> "/tmp/repeat-$i.log" ) &
      done; wait
      { echo "# the repeat test at ${REPEAT_CALLS:-120} calls, every device policy, ${REPEAT_PROCS:-8} processes at once"
        for i in $(seq 1 ${REPEAT_PROCS:-8}); do echo "-- process $i"; tail -6 "/tmp/repeat-$i.log"; done; } > "$OUT/ensure-repeat.log"
      echo "ensure-repeat: $(grep -c '^exit 0' "$OUT/ensure-repeat.log") of ${REPEAT_PROCS:-8} processes clean" ;;
    markov-cost)
      # markov's learning launches beside lru, its rows kernel at ROW_WARPS (the product's) and at 4 warps
      timeout 200 python3 benchmarks/bench_ensure.py --reps 8 --calls 32 --policies lru,markov:E128,markov:E512 \
        --out "$OUT/ensure-markov.json" 2>&1 | tail -4
      timeout 150 python3 -c "
import runpy, sys
import expertcache.device.markov as m
m.ROW_WARPS = 4
sys.argv = ['bench_ensure.py', '--reps', '8', '--calls', '32', '--policies', 'markov:E128,markov:E512',
            '--out', '$OUT/ensure-markov-w4.json']
runpy.run_path('benchmarks/bench_ensure.py', run_name='__main__')
" 2>&1 | tail -4 ;;
    copy)
      timeout 300 python3 benchmarks/bench_copy.py --out "$OUT/copy.json" 2>&1 | tee "$OUT/copy.log" | tail -20 ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 3 python3 benchmarks/sanitize_step.py \
          > "$OUT/sanitize-$tool.log" 2>&1; echo "compute-sanitizer $tool: exit $?"; tail -3 "$OUT/sanitize-$tool.log"
      done ;;
    moe)
      # files named: the server tests import fastapi, which the GPU image lacks
      timeout -s INT -k 20 ${MOE_TEST_TIMEOUT:-300} python3 -m pytest -q -rfE -p no:cacheprovider -n "${GPU_TEST_WORKERS:-8}" -m gpu \
        tests/moe/engine/test_layer.py tests/moe/kernels/test_router.py tests/moe/kernels/test_routed.py tests/benchmarks/test_kernel_trace.py \
        tests/expertcache/test_streams.py ${MOE_TEST_EXTRA:-} 2>&1 | tee "$OUT/gpu-tests-moe.log" | tail -12 ;;
    formats)
      # the expert formats: routed GEMM and layer (overlap on / off bitwise) against their references, the
      # quantized checkpoints with a shared expert; compiles dominate (about 9 minutes on 14 workers)
      timeout -s INT -k 20 ${FORMATS_TEST_TIMEOUT:-560} python3 -m pytest -q -rfE -p no:cacheprovider -n "${GPU_TEST_WORKERS:-14}" -m gpu \
        tests/moe/kernels/test_routed_formats.py tests/moe/engine/test_layer_formats.py tests/moe/model/test_checkpoint_quantized.py \
        2>&1 | tee "$OUT/gpu-tests-formats.log" | tail -6 ;;
    formats-engine)
      # the engine with every format's experts against transformers on the decoded experts (one process: graphs)
      timeout ${FORMATS_ENGINE_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/engine/test_engine_gpu.py \
        -k quantized 2>&1 | tee "$OUT/gpu-tests-formats-engine.log" | tail -4 ;;
    decode-formats)
      timeout ${DECODE_FORMATS_TIMEOUT:-300} python3 benchmarks/bench_decode.py --geometry qwen3-30b --layers 16 \
        --moe-cache-gb ${DECODE_FORMATS_GB:-2.5,4.5} --expert-formats bf16,fp8,nvfp4,int4 --configs lru --batches 1 \
        --warmup ${DECODE_FORMATS_WARMUP:-200} --steps ${DECODE_FORMATS_STEPS:-300} --out "$OUT/decode-formats.json" \
        2>&1 | tee "$OUT/decode-formats.log" | tail -14 ;;
    prefill)
      # time to first token of 1K / 8K / 32K prompts with a quarter of the experts in slots, against the copy limit
      timeout ${PREFILL_TIMEOUT:-540} python3 benchmarks/bench_prefill.py ${PREFILL_ARGS:-} --out "$OUT/prefill.json" \
        --trace-out "$OUT/prefill-trace.json" 2>&1 | tee "$OUT/prefill.log" | tail -6
      gzip -f "$OUT/prefill-trace.json" ;;  # tens of MB of JSON: compressed, it comes back
    decode-trace)
      # markov beside lru and rule on FLAME-MoE-290M's real routing at its MoE geometry, a quarter and half
      # of the experts in slots, the simulator's prediction beside each (carry .traces)
      for frac in 0.25 0.5; do
        timeout ${DECODE_TRACE_TIMEOUT:-250} python3 benchmarks/bench_decode.py --geometry flame-290m \
          --trace .traces/flame-290m-a.npz --layers 8 --slots-frac $frac --configs lru,rule,markov --batches 1 \
          --out "$OUT/decode-trace-$frac.json" 2>&1 | tee "$OUT/decode-trace-$frac.log" | tail -6
      done ;;
    decode-trace-mixtral)
      # markov beside lru and rule on Mixtral-8x7B's real routing (GSM8K, its first 8 layers) at Mixtral's
      # geometry (352 MB bf16 experts), a quarter and half of the experts in slots (carry .traces)
      for frac in 0.25 0.5; do
        timeout ${DECODE_TRACE_MIXTRAL_TIMEOUT:-280} python3 benchmarks/bench_decode.py --geometry mixtral-8x7b \
          --trace .traces/mixtral-gsm8k.npz --layers 8 --slots-frac $frac --configs lru,rule,markov --batches 1 \
          --warmup 44 --steps 200 --vocab 32000 --out "$OUT/decode-trace-mixtral-$frac.json" 2>&1 \
          | tee "$OUT/decode-trace-mixtral-$frac.log" | tail -6
      done ;;
    decode-hybrid-trace)
      # copy against hybrid on real routing at its own geometry: FLAME-MoE-290M (its 8 MoE layers) at a tenth and a
      # quarter of the experts in slots, Mixtral-8x7B's first 8 layers at a quarter, per format, the simulator
      # beside each row (carry .traces)
      export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
      for frac in ${DHT_FRACS:-0.1 0.25}; do
        timeout ${DHT_TIMEOUT:-200} python3 benchmarks/bench_decode.py --geometry flame-290m \
          --trace .traces/flame-290m-a.npz --layers 8 --slots-frac $frac --expert-formats ${DHT_FORMATS:-bf16,int4} \
          --configs lru --batches 1 --miss-service copy,hybrid --out "$OUT/decode-hybrid-flame-$frac.json" 2>&1 \
          | tee "$OUT/decode-hybrid-flame-$frac.log" | tail -6
      done
      timeout ${DHT_MIXTRAL_TIMEOUT:-280} python3 benchmarks/bench_decode.py --geometry mixtral-8x7b \
        --trace .traces/mixtral-gsm8k.npz --layers 8 --slots-frac 0.25 --expert-formats ${DHT_MIXTRAL_FORMATS:-int4} \
        --configs lru --batches 1 --warmup 44 --steps 200 --vocab 32000 --miss-service copy,hybrid \
        --out "$OUT/decode-hybrid-mixtral.json" 2>&1 | tee "$OUT/decode-hybrid-mixtral.log" | tail -6 ;;
    hybrid)
      # the miss split on the GPU: hybrid / cpu decode of every family, the channels measured at start,
      # the layer with its plan's CPU share; each worker's CPU experts on HYBRID_TEST_THREADS threads, whose
      # pool spins between calls: the workers' threads together stay within the cores
      NUMBA_NUM_THREADS=${HYBRID_TEST_THREADS:-4} timeout -s INT -k 20 ${HYBRID_TEST_TIMEOUT:-400} python3 -m pytest -q -rfE -p no:cacheprovider -n "${GPU_TEST_WORKERS:-6}" -m gpu \
        tests/moe/engine/test_hybrid_gpu.py tests/moe/engine/test_layer.py tests/expertcache/test_device_ensure_gpu.py \
        tests/moe/engine/test_model_gpt_oss.py::test_gpu_split_decode_of_gpt_oss_matches_transformers \
        -k "${HYBRID_K:-not nothing}" 2>&1 | tee "$OUT/gpu-tests-hybrid.log" | tail -8 ;;
    hybrid-step)
      # one hybrid decode step on a Perfetto timeline: the GPU kernels, the copies and the CPU workers
      export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
      timeout ${HYBRID_STEP_TIMEOUT:-240} python3 benchmarks/hybrid_step.py ${HYBRID_STEP_ARGS:-} \
        --trace-out "$OUT/hybrid-step-trace.json.gz" --out "$OUT/hybrid-step.json" > "$OUT/hybrid-step.log" 2>&1; echo "hybrid-step: exit $?"
      tail -12 "$OUT/hybrid-step.log" ;;
    sanitize-hybrid)
      # the hand-off's kernels and the split ensure under compute-sanitizer (a small model, equal channels);
      # racecheck's reports are counted by kernel: cuBLAS's nvjet GEMMs and cuDNN's attention are vendor
      # kernels, the rest this project's
      export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
      for tool in memcheck racecheck; do
        timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 3 python3 benchmarks/hybrid_step.py \
          --small --even --warmup 3 --steps 2 > "$OUT/sanitize-hybrid-$tool.log" 2>&1
        echo "compute-sanitizer $tool (hybrid): exit $?"; tail -3 "$OUT/sanitize-hybrid-$tool.log"
      done
      grep "Race reported" "$OUT/sanitize-hybrid-racecheck.log" | sed 's/.* at \([^+]*\)+.*/\1/' | sort | uniq -c \
        | awk '{v = ($2 ~ /^(nvjet|cudnn|cutlass|sm90_xmma)/) ? "vendor" : "ours"; print "racecheck reports in", v, "kernel", $2 ":", $1}' ;;
    decode-hybrid)
      # decode tok/s against the VRAM budget at Qwen3-30B-A3B's 48 layers, copy and hybrid over the same weights,
      # per format, the simulator beside each row (run a format or two per call: a 48-layer bf16 store is 58 GB)
      export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
      timeout ${DECODE_HYBRID_TIMEOUT:-560} python3 benchmarks/bench_decode.py --geometry qwen3-30b \
        --layers ${DECODE_HYBRID_LAYERS:-48} --moe-cache-gb ${DECODE_HYBRID_GB:-2,4,8,16} \
        --expert-formats ${DECODE_HYBRID_FORMATS:-bf16} --configs lru --batches 1 --warmup 100 --steps 200 \
        --miss-service copy,hybrid --out "$OUT/decode-hybrid-${DECODE_HYBRID_FORMATS:-bf16}.json" 2>&1 \
        | tee "$OUT/decode-hybrid.log" | tail -14 ;;
    agent)
      # a coding agent's session through the scheduler at Qwen3-30B-A3B geometry, every layer, a quarter of the
      # experts in slots: time to first token per turn with the prefix cache and without, side calls beside it
      timeout ${AGENT_TIMEOUT:-560} python3 benchmarks/bench_agent.py ${AGENT_ARGS:-} --out "$OUT/agent.json" 2>&1 \
        | tee "$OUT/agent.log" | tail -40 ;;
    long-context)
      # a 256K-token prompt through the scheduler at Qwen3-30B-A3B geometry, alone and beside 3 side calls
      # during its prefill and 3 during its decode (LONG_ARGS: e.g. --layers 24 where 48 do not fit)
      timeout ${LONG_TIMEOUT:-580} python3 benchmarks/bench_long_context.py ${LONG_ARGS:-} \
        --out "$OUT/long-context.json" 2>&1 | tee "$OUT/long-context.log" | tail -8 ;;
    agent-soak)
      # the same session repeated with the prefix cache for AGENT_SOAK_MINUTES (every request must end well)
      timeout 590 python3 benchmarks/bench_agent.py --minutes ${AGENT_SOAK_MINUTES:-7} ${AGENT_ARGS:-} \
        --out "$OUT/agent-soak.json" 2>&1 | tee "$OUT/agent-soak.log" | tail -12 ;;
    agent-soak-start)
      # the soak past one command's limit: the session repeated with the prefix cache for AGENT_SOAK_MINUTES
      # in a session of its own, returning at once; agent-soak-wait waits for it (the machine must stay held)
      W=${SOAK_WORK:-.soak-work}; mkdir -p "$W"; rm -f "$W/done" "$W/rc"
      setsid nohup bash -c "python3 benchmarks/bench_agent.py --minutes ${AGENT_SOAK_MINUTES:-11} ${AGENT_ARGS:-} \
          --out $W/agent-soak.json > $W/agent-soak.log 2>&1; echo \$? > $W/rc; touch $W/done" > /dev/null 2>&1 < /dev/null &
      echo "agent-soak-start: started in the background (agent-soak-wait waits for it)" ;;
    agent-soak-wait)
      W=${SOAK_WORK:-.soak-work}; t0=$(date +%s)
      while [ ! -f "$W/done" ] && [ $(( $(date +%s) - t0 )) -lt ${SOAK_WAIT_TIMEOUT:-560} ]; do sleep 5; done
      echo "agent-soak-wait: $(( $(date +%s) - t0 )) s; exit code: $(cat "$W/rc" 2>/dev/null || echo 'still running')"
      cp "$W"/agent-soak.* "$OUT/" 2>/dev/null; tail -12 "$W/agent-soak.log"; [ -f "$W/done" ] ;;
    peer-setup)
      # peer-build's and peer-convert's work in a session of its own, returning at once: the build, the
      # checkpoint beside it, then the GGUFs, while later parts (GPU tests) run; peer-wait waits for it.
      # The machine must stay held between the calls (PEER_WORK is kept only while it is)
      W=${PEER_WORK:-.peer-work}; mkdir -p "$W/log"; rm -f "$W/setup.done" "$W"/log/*.rc
      setsid nohup bash -c "
        ( python3 benchmarks/peer_llamacpp.py build --build-dir $W > $W/log/peer-build.log 2>&1; echo \$? > $W/log/build.rc ) &
        ( python3 benchmarks/peer_llamacpp.py checkpoint --out $W/qwen3moe --layers ${PEER_LAYERS:-12} --device cuda \
            > $W/log/peer-checkpoint.log 2>&1; echo \$? > $W/log/checkpoint.rc ) &
        wait
        python3 benchmarks/peer_llamacpp.py convert --model $W/qwen3moe --build-dir $W > $W/log/peer-convert.log 2>&1
        echo \$? > $W/log/convert.rc; touch $W/setup.done" > /dev/null 2>&1 < /dev/null &
      echo "peer-setup: started in the background (peer-wait waits for it)" ;;
    peer-wait)
      W=${PEER_WORK:-.peer-work}; t0=$(date +%s)
      while [ ! -f "$W/setup.done" ] && [ $(( $(date +%s) - t0 )) -lt ${PEER_WAIT_TIMEOUT:-540} ]; do sleep 3; done
      echo "peer-wait: $(( $(date +%s) - t0 )) s; exit codes (build, checkpoint, convert):" \
        $(cat "$W/log/build.rc" "$W/log/checkpoint.rc" "$W/log/convert.rc" 2>/dev/null)
      cp "$W"/log/peer-*.log "$OUT/" 2>/dev/null; [ -f "$W/setup.done" ] ;;
    peer-build)
      # llama.cpp beside expertcache (benchmarks/peer_llamacpp.py; carry .peer from `peer_llamacpp.py prepare`):
      # the build, then the shared random-weight checkpoint; PEER_WORK (.peer-work, ignored by git, not carried)
      # is kept between calls while the machine is held
      timeout 560 sh -c "python3 benchmarks/peer_llamacpp.py build --build-dir ${PEER_WORK:-.peer-work} > $OUT/peer-build.log 2>&1 &&
        python3 benchmarks/peer_llamacpp.py checkpoint --out ${PEER_WORK:-.peer-work}/qwen3moe --layers ${PEER_LAYERS:-12} \
          --device cuda >> $OUT/peer-build.log 2>&1"; echo "peer-build: exit $?"; tail -4 "$OUT/peer-build.log" ;;
    peer-convert)
      timeout 560 python3 benchmarks/peer_llamacpp.py convert --model ${PEER_WORK:-.peer-work}/qwen3moe \
        --build-dir ${PEER_WORK:-.peer-work} > "$OUT/peer-convert.log" 2>&1; echo "peer-convert: exit $?"; tail -14 "$OUT/peer-convert.log" ;;
    peer-llama)
      # results gather in PEER_WORK/results (kept between calls); each part copies them to $OUT
      timeout 560 python3 benchmarks/peer_llamacpp.py bench-llama --model ${PEER_WORK:-.peer-work}/qwen3moe \
        --build-dir ${PEER_WORK:-.peer-work} --out ${PEER_WORK:-.peer-work}/results 2>&1 | grep -v '^ ' \
        | tee "$OUT/peer-llama.log" | tail -14; cp ${PEER_WORK:-.peer-work}/results/*.json "$OUT/" ;;
    peer-ours)
      timeout 560 python3 benchmarks/peer_llamacpp.py bench-ours --model ${PEER_WORK:-.peer-work}/qwen3moe \
        --out ${PEER_WORK:-.peer-work}/results --formats ${PEER_FORMATS:-bf16,fp8,int4,nvfp4} ${PEER_OURS_ARGS:-} 2>&1 \
        | grep -v '^ ' | tee "$OUT/peer-ours.log" | tail -34; cp ${PEER_WORK:-.peer-work}/results/*.json "$OUT/" ;;
    peer-report)
      python3 benchmarks/peer_llamacpp.py limits --out ${PEER_WORK:-.peer-work}/results > "$OUT/peer-limits.log" 2>&1
      python3 benchmarks/peer_llamacpp.py report --out ${PEER_WORK:-.peer-work}/results 2>&1 | grep -v '^ ' \
        | tee "$OUT/peer-report.log" | tail -20; cp ${PEER_WORK:-.peer-work}/results/*.json "$OUT/" ;;
    step)
      # a whole decode step, every expert resident, against its HBM floor
      timeout ${STEP_TIMEOUT:-540} python3 benchmarks/bench_step.py ${STEP_ARGS:---transformers} --out "$OUT/step.json" \
        --trace-out "$OUT/step-trace.json" 2>&1 | tee "$OUT/step.log" | tail -8 ;;
    router)
      timeout ${ROUTER_TIMEOUT:-200} python3 benchmarks/bench_router.py ${ROUTER_ARGS:-} --out "$OUT/router.json" \
        2>&1 | tee "$OUT/router.log" | tail -30 ;;
    routed)
      timeout 300 python3 benchmarks/bench_routed.py ${ROUTED_ARGS:---configs sweep --tokens 1,2,4,8} --out "$OUT/routed.json" \
        2>&1 | tee "$OUT/routed.log" | tail -12 ;;
    mma)
      # the tensor-core routed kernels' GPU tests: the kernels at the real shapes for T = 1..64, graph
      # replay; the engine under EXPERTCACHE_ROUTED_MMA=1 against transformers
      timeout -s INT -k 20 ${MMA_TEST_TIMEOUT:-300} python3 -m pytest -q -rfE -p no:cacheprovider -n "${GPU_TEST_WORKERS:-14}" -m gpu \
        tests/moe/kernels/test_routed_mma.py tests/moe/engine/test_engine_gpu.py -k "mma or tensor_core" \
        2>&1 | tee "$OUT/gpu-tests-mma.log" | tail -6 ;;
    mma-bench)
      # the tensor-core routed kernels beside the one-program-a-pair kernels and the read floor, one run
      timeout ${MMA_BENCH_TIMEOUT:-420} python3 benchmarks/bench_routed.py ${MMA_ARGS:---mma default --read-floor \
        --tokens 1,2,4,8,16,32,64 --shapes qwen3-30b,qwen3-next --formats bf16,fp8,nvfp4,int4} \
        --out "$OUT/routed-mma.json" 2>&1 | tee "$OUT/routed-mma.log" | tail -40 ;;
    overlap)
      mkdir -p "$OUT/moe"
      timeout ${OVERLAP_TIMEOUT:-400} python3 benchmarks/bench_moe_copy_overlap.py --out-dir "$OUT/moe" ${OVERLAP_ARGS:-} 2>&1 | tee "$OUT/moe/bench.log" | tail -14
      (cd "$OUT/moe" && tar czf traces.tgz $(ls *.json | grep -v results.json) && rm -f $(ls *.json | grep -v results.json)) ;;
    resident)
      # the resident-layer marginal: one more layer of 12 with every expert resident, overlap off and on,
      # under the resolved launch plan, with its kernel profile
      mkdir -p "$OUT/resident"
      timeout ${RESIDENT_TIMEOUT:-240} python3 benchmarks/bench_moe_copy_overlap.py --out-dir "$OUT/resident" --no-miss-mode \
        --layers 12 --marginal-from 4 ${RESIDENT_ARGS:-} 2>&1 | tee "$OUT/resident/bench.log" | tail -14
      rm -f "$OUT"/resident/*replays_*.json ;;
    engine)
      timeout 300 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/moe/engine/test_engine_gpu.py \
        2>&1 | tee "$OUT/gpu-tests-engine.log" | tail -8 ;;
    qwen3-next)
      # Qwen3-Next's pieces: the delta-rule kernels, the linear-attention layer, the fused norms / RoPE with
      # (1 + w) norms and partial rotary, the fused step and chunked prefill, the prefill staging ring
      timeout ${QWEN3_NEXT_TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -n "${GPU_TEST_WORKERS:-8}" \
        tests/moe/kernels/test_delta_rule.py tests/moe/engine/test_linear_attention.py tests/moe/kernels/test_decode_norm.py \
        tests/moe/engine/test_decode_fused.py tests/moe/engine/test_prefill_staging.py 2>&1 | tee "$OUT/gpu-tests-qwen3-next.log" | tail -6 ;;
    decode-qwen3-next)
      # Qwen3-Next's own decoder (8 layers: 2 gated full attention, 6 Gated DeltaNet) at a quarter and half of
      # the experts in slots, the simulator's prediction beside each
      for frac in 0.25 0.5; do
        timeout ${DECODE_QWEN3_NEXT_TIMEOUT:-250} python3 benchmarks/bench_decode.py --geometry qwen3-next-80b \
          --layers 8 --slots-frac $frac --configs ${DECODE_QWEN3_NEXT_CONFIGS:-lru,rule+overlap} --batches 1 \
          --out "$OUT/decode-qwen3-next-$frac.json" 2>&1 | tee "$OUT/decode-qwen3-next-$frac.log" | tail -6
      done ;;
    gpt-oss)
      # gpt-oss's block on the GPU: the router with its bias, the routed kernels with biases and the clamped
      # SwiGLU (dense and MXFP4), the engine against transformers (CUDA graphs, every policy, overlap on / off)
      timeout -s INT -k 20 ${GPT_OSS_TEST_TIMEOUT:-400} python3 -m pytest -q -rfE -p no:cacheprovider -n "${GPU_TEST_WORKERS:-8}" -m gpu \
        tests/moe/kernels/test_routed_gpt_oss.py tests/moe/kernels/test_router.py tests/moe/engine/test_model_gpt_oss.py \
        2>&1 | tee "$OUT/gpu-tests-gpt-oss.log" | tail -6 ;;
    decode-gpt-oss)
      # gpt-oss-20b's own decoder (8 of its 24 layers) at a quarter and half of the experts in slots, its released
      # MXFP4 experts and bf16, the simulator's prediction beside each
      for frac in 0.25 0.5; do
        timeout ${DECODE_GPT_OSS_TIMEOUT:-280} python3 benchmarks/bench_decode.py --geometry gpt-oss-20b \
          --layers 8 --slots-frac $frac --expert-formats ${DECODE_GPT_OSS_FORMATS:-mxfp4,bf16} \
          --configs ${DECODE_GPT_OSS_CONFIGS:-lru,rule} --batches 1 \
          --out "$OUT/decode-gpt-oss-$frac.json" 2>&1 | tee "$OUT/decode-gpt-oss-$frac.log" | tail -8
      done ;;
    glm)
      # GLM-4.5's block on the GPU: the sigmoid / grouped router, the ungated shared expert, the engine
      # against transformers (every family of test_engine_gpu.py runs; -k picks glm4_moe's)
      timeout -s INT -k 20 ${GLM_TEST_TIMEOUT:-400} python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/moe/engine/test_engine_gpu.py \
        -k glm4 2>&1 | tee "$OUT/gpu-tests-glm.log" | tail -6 ;;
    decode-glm)
      # GLM-4.5-Air's own decoder (4 MoE layers of its 45, 35 GB of bf16 experts would not stay small) at a
      # quarter and half of the experts in slots, the simulator's prediction beside each
      for frac in 0.25 0.5; do
        timeout ${DECODE_GLM_TIMEOUT:-280} python3 benchmarks/bench_decode.py --geometry glm-4.5-air \
          --layers ${DECODE_GLM_LAYERS:-4} --slots-frac $frac --configs ${DECODE_GLM_CONFIGS:-lru,rule+overlap} \
          --batches 1 --out "$OUT/decode-glm-$frac.json" 2>&1 | tee "$OUT/decode-glm-$frac.log" | tail -8
      done ;;
    mixtral-olmoe)
      # Mixtral's and OLMoE's engines against transformers (CUDA graphs, every policy, overlap on / off), and
      # OLMoE's whole-projection q / k norms and clip_qkv in the fused decode step against the torch step
      timeout -s INT -k 20 ${MIXTRAL_OLMOE_TEST_TIMEOUT:-400} python3 -m pytest -q -rfE -p no:cacheprovider -m gpu \
        tests/moe/engine/test_engine_gpu.py tests/moe/engine/test_decode_fused.py -k "mixtral or olmoe" \
        2>&1 | tee "$OUT/gpu-tests-mixtral-olmoe.log" | tail -6 ;;
    decode-mixtral)
      # Mixtral-8x7B's own decoder (4 of its 32 layers: 352 MB a bf16 expert) at a quarter and half of the
      # experts in slots, the simulator's prediction beside each
      for frac in 0.25 0.5; do
        timeout ${DECODE_MIXTRAL_TIMEOUT:-200} python3 benchmarks/bench_decode.py --geometry mixtral-8x7b \
          --layers ${DECODE_MIXTRAL_LAYERS:-4} --slots-frac $frac --configs ${DECODE_MIXTRAL_CONFIGS:-lru,rule} \
          --vocab 32000 --batches 1 --out "$OUT/decode-mixtral-$frac.json" 2>&1 | tee "$OUT/decode-mixtral-$frac.log" | tail -8
      done ;;
    decode-olmoe)
      # OLMoE-1B-7B's own decoder, all 16 layers, at a quarter and half of the experts in slots
      for frac in 0.25 0.5; do
        timeout ${DECODE_OLMOE_TIMEOUT:-200} python3 benchmarks/bench_decode.py --geometry olmoe-1b-7b \
          --layers 16 --slots-frac $frac --configs ${DECODE_OLMOE_CONFIGS:-lru,rule} --vocab 50304 --batches 1 \
          --out "$OUT/decode-olmoe-$frac.json" 2>&1 | tee "$OUT/decode-olmoe-$frac.log" | tail -8
      done ;;
    decode)
      timeout ${DECODE_TIMEOUT:-540} python3 benchmarks/bench_decode.py --out "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | tail -12 ;;
  esac
done
