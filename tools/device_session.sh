#!/usr/bin/env bash
# One device call that gathers the GPU evidence the issues ask for, each stage logged under $OUT.
# Usage (on the GPU machine, repo root, .whl carried): tools/device_session.sh [stage ...]
# Stages: info smoke tests gpu-tests memcheck bench hazard run synthetic presets ring-check
#   fuzz faults soak sanitize sampler profile serve serve-ab torch prefill llama8b
#   (= llama8b-ttft llama8b-decode llama8b-ctx) llama8b-serve serve-http gemv tp2 tp4
# (tp2, tp4: tensor parallelism, on a machine of 2 or 4 GPUs)
# (default: info smoke tests memcheck bench hazard run, in that order).
set -uo pipefail
OUT=${OUT:-/tmp/vt-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
stages=("$@"); [ ${#stages[@]} -gt 0 ] || stages=(info smoke tests memcheck bench hazard run)
status=0
stage() {  # stage NAME CMD...: run, append to $OUT/session.log (one file: few come back), rc
  local name=$1; shift
  echo "=== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$OUT/session.log"
  "$@" 2>&1 | tee -a "$OUT/session.log" | tail -n ${STAGE_TAIL:-25}
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc ($(date -u +%H:%M:%S))" | tee -a "$OUT/session.log"
  [ "$rc" -eq 0 ] || status=1
}
for s in "${stages[@]}"; do
  case $s in
    info) stage info python3 -m vt info ;;
    smoke) stage smoke python3 tools/gpu_smoke.py ;;
    tests) stage tests python3 -m pytest -q -rs tests ;;
    gpu-tests) stage gpu-tests python3 -m pytest -q -m gpu -rfE tests -p no:cacheprovider \
                 --durations=12 ;;
    ring-check)   # the synthetic workload and the presets, ring only: D=0, S=1 and 32, 3 repeats
      stage ring-synthetic python3 -m vt bench --workload synthetic --device-us 0 --conc 1 32 \
        --modes ring --repeats 3 --warmup-s 0.5 --vocab 32000 --no-bar \
        --json "$OUT/ring-synthetic.json"
      stage ring-presets python3 -m vt bench --workload model --preset bench-small bench-dense \
        --conc 1 32 --modes ring --steps 160 --prompt-len 8 --repeats 3 --profile off --no-bar \
        --json "$OUT/ring-presets.json" ;;
    memcheck) stage memcheck1 bash tools/memcheck.sh; stage memcheck2 bash tools/memcheck.sh ;;
    bench) stage bench-dense python3 tools/bench_step.py --preset bench-dense --batch 1 8 32
           stage bench-moe python3 tools/bench_step.py --preset bench-moe --batch 1 8 32 ;;
    synthetic) stage bench-synthetic python3 -m vt bench --workload synthetic --no-bar \
                 --json "$OUT/bench-synthetic.json" ;;
    presets) for p in bench-small bench-dense bench-moe; do
               stage "bench-$p" python3 -m vt bench --workload model --preset $p --conc 1 32 64 \
                 --steps ${PRESET_STEPS:-160} --prompt-len 8 --profile ${PRESET_PROFILE:-both} \
                 --no-bar --json "$OUT/bench-$p.json"
             done ;;
    fuzz) stage fuzz python3 tools/fuzz.py --backend cuda --steps-per-mode 2000 --json "$OUT/fuzz.json" ;;
    soak) stage soak python3 tools/soak.py --backend cuda --steps 10000 ;;
    sanitize) stage sanitize bash tools/sanitize.sh all ;;
    hazard) for m in tiny-dense tiny-moe; do for c in 4 32; do
              stage "hazard-$m-$c" python3 tools/hazard_repro.py --backend cuda --model $m --conc $c --runs 5
            done; done ;;
    run) stage run python3 -m vt run ;;
    sampler) stage sampler python3 -m vt bench --workload sampler --no-bar --json "$OUT/sampler.json"
             stage sampler-ablation python3 tools/sampler_ablation.py --mode temperature --S 8 32 128 \
               --V 32000 151936 ;;
    profile) for v in control default control default; do   # the control: the noise floor
               stage "profile-$v" python3 tools/profile_overhead.py $v --workload synthetic \
                 --device-us 0 --conc 1 32 --modes drain ring --no-torch --repeats 9 --warmup-s 0.5 \
                 --vocab 32000 --steps 3000 --no-bar
             done ;;
    serve) stage serve-small python3 -m vt bench --workload serve --preset bench-small \
             --modes sync drain ring staged --arrival closed poisson --clients 16 32 --rate 100 300 \
             --output-len 128 256 --requests 96 --no-bar --json "$OUT/serve-small.json"
           stage serve-dense python3 -m vt bench --workload serve --preset bench-dense \
             --modes sync drain ring staged --arrival closed poisson --clients 16 32 --rate 30 70 \
             --output-len 128 256 --requests 64 --no-bar --json "$OUT/serve-dense.json" ;;
    prefill) stage prefill python3 tools/profile_prefill.py --preset bench-small --seqs 1 4 16 \
               --prompt-len 16 40 64 --json "$OUT/prefill.json"
             stage prefill-graph-tests env VT_PREFILL_GRAPHS=1 python3 -m pytest -q -m gpu \
               tests/executor/test_prefill_graphs.py tests/executor/test_chunked_prefill.py tests/model
             for g in 0 1; do   # eager prefill against captured prefill buckets, one call
               stage "serve-prefill-graphs-$g" env VT_PREFILL_GRAPHS=$g python3 -m vt bench \
                 --workload serve --preset bench-small --modes drain ring --arrival closed \
                 --clients 16 32 --output-len 128 256 --requests 96 --no-bar \
                 --json "$OUT/serve-prefill-graphs-$g.json"
             done ;;
    serve-ab) for p in bench-small bench-dense; do   # the closed-loop drain/ring A/B, 3 paired repeats
                stage "serve-ab-$p" python3 -m vt bench --workload serve --preset $p --modes drain ring \
                  --arrival closed --clients 16 32 --output-len 128 256 --requests 384 --repeats 3 \
                  --no-bar --json "$OUT/serve-ab-$p.json"
              done ;;
    torch) stage torch-tests python3 -m pytest -q -rs -m gpu tests/vt_torch
           stage torch-memcheck bash tools/sanitize.sh memcheck tests/vt_torch
           stage torch-bench python3 -m vt bench --workload torch --conc 1 32 --steps 100 --repeats 2 \
             --profile off --no-bar --json "$OUT/torch.json" ;;
    llama8b|llama8b-ttft|llama8b-decode|llama8b-ctx)   # llama8b: all three
      if [ $s = llama8b ] || [ $s = llama8b-ttft ]; then
        stage llama8b-ttft python3 -m vt.cli.bench.torch_ttft --conc 32 --prompt-len 512 \
          --context 640 --single 128 1024 4096 --repeats 3 --json "$OUT/llama8b-ttft.json"
      fi
      if [ $s = llama8b ] || [ $s = llama8b-decode ]; then
        stage llama8b-decode python3 -m vt.cli.bench.torch_decode --rows 1 8 32 64 \
          --live 256 2048 --max-context 4096 --steps 64 --repeats 2 \
          --json "$OUT/llama8b-decode.json" --png "$OUT/llama8b-decode.png"
      fi
      if [ $s = llama8b ] || [ $s = llama8b-ctx ]; then
        for ctx in 512 32768; do   # TPOT must not grow with max_context
          stage "llama8b-decode-ctx$ctx" python3 -m vt.cli.bench.torch_decode --rows 1 \
            --live 256 --max-context $ctx --steps 64 --repeats 3 --hf-rows --no-peer \
            --json "$OUT/llama8b-decode-ctx$ctx.json"
        done
      fi ;;
    llama8b-serve) stage llama8b-serve python3 -m vt bench --workload serve \
                     --preset torch-llama3-8b --modes drain ring --arrival closed --clients 16 32 \
                     --prompt-range 256 2048 --output-len 128 --requests 96 --repeats 2 --no-bar \
                     --json "$OUT/llama8b-serve.json" ;;
    serve-http) stage serve-http-ab python3 tools/serve_http_ab.py --shape llama3-8b \
                  --checkpoint-dir /tmp/vt-llama3-8b-shape --json "$OUT/serve-http-ab.json" ;;
    gemv) stage gemv-row-sweep python3 tools/gemv_row_sweep.py
          stage gemv-floor python3 tools/decode_floor.py --cases 1:256 1:2048 32:2048 --gemms
          for lin in torch triton; do   # cuBLAS against the Triton linear, served by vt
            stage "gemv-decode-$lin" python3 -m vt.cli.bench.torch_decode --rows 1 8 16 \
              --live 256 2048 --max-context 4096 --steps 64 --repeats 2 --hf-rows --no-peer \
              --linear $lin --json "$OUT/gemv-decode-$lin.json"
          done ;;
    faults) for b in sim cuda; do   # cuda: step faults at eager forwards, NaN rows everywhere
              stage "fault-fuzz-$b" python3 tools/fuzz.py --faults --backend $b --time-budget-s 40 \
                --json "$OUT/fuzz-faults-$b.json"
            done ;;
    tp2|tp4) n=${s#tp}
             stage "$s-tests" python3 -m pytest -q tests/parallel tests/vt_torch/test_tensor_parallel.py
             stage "$s-broadcast" python3 tools/plan_broadcast_cost.py --rows 1 8 64 \
               --json "$OUT/$s-broadcast.json"
             stage "$s-small" python3 tools/tp_generate.py --backend cuda --tensor-parallel "$n" \
               --preset small --dtype bfloat16 --json "$OUT/$s-small.json"
             stage "$s-8b" python3 tools/tp_generate.py --backend cuda --tensor-parallel "$n" \
               --preset llama3-8b --dtype bfloat16 --requests 1 --prompt-len 256 --new 128 \
               --max-context 4096 --json "$OUT/$s-8b.json"
             if [ "$n" = 4 ]; then
               stage "$s-70b" python3 tools/tp_generate.py --backend cuda --tensor-parallel 4 \
                 --preset llama3-70b --dtype bfloat16 --requests 1 --prompt-len 256 --new 128 \
                 --max-context 4096 --no-single --json "$OUT/$s-70b.json"
             fi ;;
    *) echo "unknown stage $s"; status=1 ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
exit $status
