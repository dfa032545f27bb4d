#!/usr/bin/env bash
# Rebuild the demo model from scratch: corpus, tokenizer, training, held-out score.
# Usage: run.sh OUT_DIR [train.py options...]   (intermediate files go to $WORK_DIR, default OUT_DIR/work)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: run.sh OUT_DIR [train.py options...]}
shift
work=${WORK_DIR:-$out/work}
cd "$here"
python make_corpus.py --out "$work/corpus"
md5sum "$work"/corpus/*.jsonl
python train_tokenizer.py --corpus "$work/corpus" --out "$work/tokenizer"
md5sum "$work"/tokenizer/*
python train.py --corpus "$work/corpus" --tokenizer "$work/tokenizer" --out "$out" "$@"
