#!/usr/bin/env bash
# Which kernels compile during the first loaded run after `atomctl serve` says ready (a diagnostic, issue 19):
# a cold machine's first c64 run had TTFT p99 ~2.8 s against ~2.1 s on the next one. Lists the Triton cache
# entries (kernel names) and Inductor cache files that each run added, and Dynamo's recompiles. Carry .whl.
# (Two runs on one server with one prompt seed: the second hits the prefix cache, so only its compiles count.)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
TC=${TRITON_CACHE_DIR:-$(python3 -c "import triton; print(triton.knobs.cache.dir)" 2>/dev/null || echo "$HOME/.triton/cache")}
mkdir -p "$TC"
TORCH_LOGS=recompiles python3 -m atomctl.main --log-level INFO serve --model preset:Llama-3-8B --load-format dummy --max-model-len 4096 "$@" \
  --port 8011 > /tmp/serve.log 2>&1 &
spid=$!; start=$(date +%s)
for i in $(seq 1 300); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
echo "ready after $(( $(date +%s) - start )) s"
ls "$TC" | sort > /tmp/before.txt; find /tmp/inductor -type f | sort > /tmp/ind_before.txt
for run in 1 2; do
  python3 -m atomctl.main bench serve --backend atom --base-url http://127.0.0.1:8011 --tokenizer preset:Llama-3-8B \
    --dataset-name random --random-input-len 1024 --random-output-len 128 --ignore-eos --num-prompts 320 \
    --max-concurrency 64 2>&1 | grep -E "Output token thr|Median TTFT|P99 TTFT|Median TPOT"
  ls "$TC" | sort > /tmp/after.txt; find /tmp/inductor -type f | sort > /tmp/ind_after.txt
  echo "run $run added: Triton kernels (name: count)"
  comm -13 /tmp/before.txt /tmp/after.txt | while read -r d; do ls "$TC/$d" | grep -E "\.cubin$|\.hsaco$"; done | sort | uniq -c
  echo "Inductor files: $(comm -13 /tmp/ind_before.txt /tmp/ind_after.txt | wc -l)"
  cp /tmp/after.txt /tmp/before.txt; cp /tmp/ind_after.txt /tmp/ind_before.txt
done
kill $spid; wait $spid
echo "Dynamo recompiles logged by the server:"; grep -A3 "Recompiling" /tmp/serve.log | cut -c1-300 | head -40
