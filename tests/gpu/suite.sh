#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks, a short table last. Usage: bash tests/gpu/suite.sh [quick]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null


mode=${1:-all}
summary=()
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  local start=$(date +%s)
  echo "=== $name"
  timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  summary+=("$(printf '%-28s rc=%-3s %4ss' "$name" "$rc" "$(( $(date +%s) - start ))")")
}
q06=(--model preset:Qwen3-0.6B --load-format dummy --max-model-len 4096)
l8=(--model preset:Llama-3-8B --load-format dummy --max-model-len 4096)
case $mode in
  tests|all)
    step kernel-tests 240 python3 -m pytest -q -x tests/kernels -p no:cacheprovider
    step engine-gpu-tests 300 python3 -m pytest -q -x tests/gpu -p no:cacheprovider ;;&
  bench-small|all)
    step lat-q06-bs1 200 python3 -m atomctl.main bench latency "${q06[@]}" --bs 1 --output-json "$OUT/lat_q06_bs1.json"
    step off-q06 300 python3 -m atomctl.main bench offline "${q06[@]}" --output-json "$OUT/off_q06.json" ;;&
  bench-8b|all)
    step lat-l8-bs1 200 python3 -m atomctl.main bench latency "${l8[@]}" --bs 1 --output-json "$OUT/lat_l8_bs1.json"
    step lat-l8-bs32 200 python3 -m atomctl.main bench latency "${l8[@]}" --bs 32 --output-json "$OUT/lat_l8_bs32.json"
    step off-l8 400 python3 -m atomctl.main bench offline "${l8[@]}" --output-json "$OUT/off_l8.json" ;;&
  *) ;;
esac
echo "=== summary"
printf '%s\n' "${summary[@]}"
for f in "$OUT"/*.json; do [ -f "$f" ] && python3 -c "
import json,sys; d=json.load(open('$f')); k=['output_throughput','tpot_s','startup_s','elapsed_s']
print('$(basename $f)', {x: round(d[x],4) for x in k if x in d}, {'ttft_med': round(d['ttft_s']['median'],4)} if 'ttft_s' in d else '')"; done
