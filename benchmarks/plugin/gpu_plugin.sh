#!/usr/bin/env bash
# Plugin mode on the GPU machine (vLLM 0.20.0, CUDA): `bash benchmarks/plugin/gpu_plugin.sh [STEP...]`
# from the project root, after `bash .peer/tools/run.sh install` (vLLM unpacked in /tmp/site; see
# ../shared/tools/peer-vllm/README.md), with carry [".peer/vllm/whl", ".peer/tools", ".whl"].
# STEPs (default: parity bench), each under its own `timeout`, its log in $OUT:
#   parity  tests/plugin/test_vllm_plugin_cuda.py: tiny Llama / Qwen3-MoE / DeepSeek-V2 through vllm.LLM
#           with our plugin (CUDA graphs, and Llama eager) equal HF token for token, our class the one
#           built; ATOM_DISABLE_VLLM_PLUGIN=1 builds vLLM's. The vLLM runs' logs: $OUT/parity_*.log.
#   bench   .peer/tools/vllm_bench.py llama-3-8b (dummy weights: nano workload, batch 1 and 32), the
#           plugin on, then off (ATOM_DISABLE_VLLM_PLUGIN=1: vLLM's own classes), in one vLLM and one
#           PYTHONPATH: one RESULT line per number, tagged "plugin": "on" / "off".
#   online  Llama-3-8B (dummy) served by `vllm serve` with the plugin on, off (vLLM's classes, FLASH_ATTN as
#           run.sh's native row) and by `atomctl serve`, each driven by vLLM's `vllm bench serve`: random
#           1,024 in / 128 out, c64, 320 prompts, seed 0, --ignore-eos (a fresh server each: no prefix hits).
#           ONLINE_ENGINES picks among "on off atom" (default all three); results in $OUT/online_*.json.
#   steady  benchmarks/plugin/steady_steps.py on Llama-3-8B (dummy), the plugin on, then off: vLLM's engine
#           stepped at a steady 64 requests in flight (1,024 in / 128 out), step times with and without
#           prefill rows, and the kernels of 40 profiled steps by device time (STEADY_ARGS: its options).
#   moe     the bench workload on MoE models with the plugin on and off, both loading one random
#           checkpoint (.peer/tools/mk_ckpt.py into /dev/shm: routing, and so a step's work, depends on the
#           weights). MOE_MODELS: vllm_bench.py names (default "qwen3-30b-a3b deepseek-v2-lite").
# vLLM finds our plugin through a dist-info that benchmarks/plugin/dist_info.py writes into /tmp/atom_dist
# (on PYTHONPATH after vLLM, the checkout and the stubs), as `pip install` would: no install there.
# T_SETUP / T_PARITY / T_PLUGIN / T_NATIVE / T_SERVE: each step's (or server's) time limit in seconds. PARITY_K: a pytest -k
# expression selecting parity tests (default all); BENCH_MODES: "on off" (default), "on" or "off".
# DRY=1 (any machine, no GPU): checks the paths, the dist-info (importlib lists our entry point) and the
# tests' collection, and prints the commands instead of running them; PEER / WHL point it at another tree's
# .peer / .whl (e.g. DRY=1 PEER=../main/.peer WHL=../main/.whl on the CPU machine).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} VLLM_ALLREDUCE_USE_SYMM_MEM=0 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
top=$PWD; PEER=${PEER:-$top/.peer}; WHL=${WHL:-$top/.whl}; DRY=${DRY:-}
SITE=/tmp/site; SITE2=/tmp/site2; DIST=${DIST:-/tmp/atom_dist}
VP="$SITE:$PEER/tools/vllm_stubs:$top:$DIST"   # the vLLM processes' path: vLLM, stubs, atom_core, our dist-info
TP="$top:$SITE2"                               # the test process's path: atom_core and its server's wheels
steps=${*:-parity bench}

fail() { echo "gpu_plugin.sh: $*"; exit 3; }
for s in $steps; do  # every step named right before any runs
  case $s in parity|bench|online|moe|steady) ;; *) fail "unknown step $s (parity, bench, online, moe, steady)" ;; esac
done
for m in ${BENCH_MODES:-on off}; do case $m in on|off) ;; *) fail "BENCH_MODES: on and/or off, not $m" ;; esac; done
for e in ${ONLINE_ENGINES:-on off atom}; do
  case $e in on|off|atom) ;; *) fail "ONLINE_ENGINES: on, off and/or atom, not $e" ;; esac
done
run() { if [ -n "$DRY" ]; then echo "DRY: $*"; else "$@"; fi; }
gpu_idle() {  # wait (<= 30 s) until the last step's processes released the GPU
  [ -n "$DRY" ] && return
  for _ in $(seq 1 30); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && return; sleep 1; done
  echo "GPU still busy: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
}
# step NAME LIMIT CMD...: CMD in its own process group under `timeout` (vLLM's engine-core processes are
# killed with it), output in $OUT/NAME.log; prints rc, seconds and the log's RESULT lines.
step() {
  local name=$1 limit=$2; shift 2
  if [ -n "$DRY" ]; then echo "DRY: [$name, ${limit}s] $*"; return 0; fi
  local start=$(date +%s) pid rc
  setsid timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1 &
  pid=$!; wait $pid; rc=$?
  kill -KILL -- -$pid 2>/dev/null; gpu_idle
  echo "== $name rc=$rc $(( $(date +%s) - start ))s"
  return $rc
}

# serve_and_bench NAME SERVER...: SERVER in the background until /health answers (<= T_SERVE s), then
# vLLM's bench client at c64; prints the client's summary lines, then stops the server's process group.
serve_and_bench() {
  local name=$1; shift
  if [ -n "$DRY" ]; then echo "DRY: [online_$name] $* ; vllm bench serve --max-concurrency 64"; return 0; fi
  local start=$(date +%s) spid
  setsid "$@" > "$OUT/serve_$name.log" 2>&1 & spid=$!
  for _ in $(seq 1 "${T_SERVE:-240}"); do
    curl -sf 127.0.0.1:8011/health > /dev/null && break
    kill -0 $spid 2>/dev/null || { echo "$name server died:"; tail -5 "$OUT/serve_$name.log"; return 1; }
    sleep 1
  done
  echo "== online_$name ready after $(( $(date +%s) - start ))s"
  env PYTHONPATH="$SITE:$PEER/tools/vllm_stubs" timeout 240 python3 -m vllm.entrypoints.cli.main bench serve \
    --backend vllm --model llama --tokenizer /tmp/model-llama-3-8b --base-url http://127.0.0.1:8011 \
    --dataset-name random --random-input-len 1024 --random-output-len 128 --num-prompts 320 --max-concurrency 64 \
    --request-rate inf --ignore-eos --seed 0 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$OUT" --result-filename "online_$name.json" > "$OUT/online_$name.log" 2>&1
  grep -E "Output token throughput|Median TTFT|P99 TTFT|Median TPOT|Median ITL" "$OUT/online_$name.log"
  grep -m1 -hE "atom_core's .* runs |atom_core plugin off" "$OUT/serve_$name.log" | cut -c1-200
  kill -TERM -- -$spid 2>/dev/null; sleep 8; kill -KILL -- -$spid 2>/dev/null; gpu_idle
}

# ---- setup: vLLM's wheels, ours, the dist-info; vLLM must list our entry point
for p in "$PEER/vllm/whl" "$PEER/tools/vllm_bench.py" "$PEER/tools/vllm_stubs" "$WHL" benchmarks/plugin/dist_info.py \
         tests/plugin/test_vllm_plugin_cuda.py; do
  [ -e "$p" ] || fail "missing $p (carry .peer/vllm/whl, .peer/tools and .whl; run from the project root)"
done
if [ -z "$DRY" ]; then
  [ -d $SITE/vllm ] || fail "no vLLM in $SITE: run 'bash .peer/tools/run.sh install' first (two calls, warm machine)"
  timeout "${T_SETUP:-120}" python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE "$PEER"/vllm/whl/*.whl 2>&1 | grep -v WARNING
  timeout "${T_SETUP:-120}" python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE2 "$WHL"/*.whl 2>&1 | grep -v WARNING
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fi
git rev-parse --short HEAD 2>/dev/null
rm -rf "$DIST"; python3 -m benchmarks.plugin.dist_info "$DIST" || fail "could not write the dist-info"
# importlib as vLLM's plugin loader calls it (vllm.plugins.load_plugins_by_group), over the vLLM processes' path
PYTHONPATH=$DIST python3 -c "
import importlib.metadata as m, sys
found = [e.value for e in m.entry_points(group='vllm.general_plugins')]
print('vllm.general_plugins:', found)
sys.exit(0 if 'atom_core.plugin:register' in found else 1)" || fail "importlib does not list atom_core's entry point"
for s in $steps; do
  case $s in
  parity)
    collect=(python3 -m pytest -q -p no:cacheprovider --collect-only tests/plugin/test_vllm_plugin_cuda.py)
    if [ -n "$DRY" ]; then PYTHONPATH=$TP "${collect[@]}" | tail -1; fi
    rm -rf /tmp/plugin_pytest
    step parity "${T_PARITY:-240}" env PYTHONPATH=$TP ATOM_VLLM_PYTHONPATH="$SITE:$PEER/tools/vllm_stubs:$DIST" \
      python3 -m pytest -q -p no:cacheprovider --tb=short -rA --basetemp=/tmp/plugin_pytest ${PARITY_K:+-k "$PARITY_K"} \
      tests/plugin/test_vllm_plugin_cuda.py
    [ -z "$DRY" ] && { grep -E "passed|failed|PASSED|FAILED|ERROR|SKIPPED" "$OUT/parity.log" | tail -12
      i=0; for f in $(find /tmp/plugin_pytest -name driver.log 2>/dev/null); do cp "$f" "$OUT/parity_$i.log"; i=$((i+1)); done; }
    ;;
  bench)
    for mode in ${BENCH_MODES:-on off}; do
      off=$([ $mode = off ] && echo 1 || echo 0)
      step "bench_plugin_$mode" "$([ $mode = on ] && echo "${T_PLUGIN:-200}" || echo "${T_NATIVE:-220}")" \
        env PYTHONPATH=$VP ATOM_DISABLE_VLLM_PLUGIN=$off python3 "$PEER/tools/vllm_bench.py" llama-3-8b
      [ -z "$DRY" ] && { grep -h "^RESULT " "$OUT/bench_plugin_$mode.log" | sed "s/^RESULT {/{\"plugin\": \"$mode\", /"
        # which classes ran: our adapter's line (plugin on) or the switch's (off); the last error otherwise
        grep -m2 -hE "atom_core's .* runs |atom_core plugin off" "$OUT/bench_plugin_$mode.log" | cut -c1-220
        grep -q "nano_workload" "$OUT/bench_plugin_$mode.log" || tail -25 "$OUT/bench_plugin_$mode.log"; }
    done
    ;;
  online)
    model=/tmp/model-llama-3-8b
    run env PYTHONPATH=$TP python3 -m benchmarks.engine.model_dir preset:Llama-3-8B $model || fail "no model directory"
    for eng in ${ONLINE_ENGINES:-on off atom}; do
      case $eng in
      on) server=(env PYTHONPATH=$VP python3 -m vllm.entrypoints.cli.main serve $model) ;;
      off) server=(env PYTHONPATH=$VP ATOM_DISABLE_VLLM_PLUGIN=1 python3 -m vllm.entrypoints.cli.main serve $model
                   --attention-backend FLASH_ATTN) ;;
      atom) server=(env PYTHONPATH=$TP python3 -m atomctl.main serve --model $model) ;;
      esac
      serve_and_bench "$eng" "${server[@]}" --load-format dummy --port 8011 --max-model-len 4096 --served-model-name llama
    done
    ;;
  moe)
    for name in ${MOE_MODELS:-qwen3-30b-a3b deepseek-v2-lite}; do
      run env PYTHONPATH=$TP python3 "$PEER/tools/mk_ckpt.py" "$name" || fail "mk_ckpt.py $name failed"
      for mode in ${BENCH_MODES:-on off}; do
        off=$([ $mode = off ] && echo 1 || echo 0)
        step "moe_${name}_$mode" "${T_PLUGIN:-260}" env PYTHONPATH=$VP ATOM_DISABLE_VLLM_PLUGIN=$off \
          CKPT_DIR=/dev/shm/ckpt-$name python3 "$PEER/tools/vllm_bench.py" "$name"
        [ -z "$DRY" ] && grep -h "^RESULT " "$OUT/moe_${name}_$mode.log" | sed "s/^RESULT {/{\"plugin\": \"$mode\", /"
      done
      run rm -rf "/dev/shm/ckpt-$name"
    done
    ;;
  steady)
    model=/tmp/model-llama-3-8b
    run env PYTHONPATH=$TP python3 -m benchmarks.engine.model_dir preset:Llama-3-8B $model || fail "no model directory"
    for mode in ${BENCH_MODES:-on off}; do
      off=$([ $mode = off ] && echo 1 || echo 0)
      step "steady_$mode" "${T_PLUGIN:-200}" env PYTHONPATH=$VP ATOM_DISABLE_VLLM_PLUGIN=$off \
        python3 benchmarks/plugin/steady_steps.py $model ${STEADY_ARGS:-}
      [ -z "$DRY" ] && { grep -A40 "^RESULT " "$OUT/steady_$mode.log" || tail -30 "$OUT/steady_$mode.log"; }
    done
    ;;
  *) fail "unknown step $s (parity, bench, online, moe, steady)" ;;
  esac
done
exit 0
