#!/usr/bin/env bash
# Regenerates the quoted benchmark results in benchmarks/results/ (JSON, PNG, markdown summary)
# with one `omnistage bench` run: a stack started for the run on free loopback ports, closed-loop
# concurrency 1, 4, 8 and 16, 16 requests per level, every baseline (monolithic generate(), in-process
# pipeline, full_payload, each stage alone) in the same run. Extra arguments are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin/omnistage
[ -x "$BIN" ] || BIN=omnistage
OUT=benchmarks/results
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
"$BIN" bench --serve --concurrency 1,4,8,16 --num-requests 16 \
    --json "$OUT/bench.json" --plot "$OUT/bench.png" --markdown "$OUT/README.md" "$@"
