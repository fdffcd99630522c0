#!/usr/bin/env bash
# The GPU checks of issue 19, as run on the device machine (an H100: Python 3.12, its own CUDA torch;
# the project's other pinned packages travel as wheels in .whl/, made here by benchmarks/gpu/wheels.sh). Usage:
#   benchmarks/gpu/run.sh setup tests graph-tests graphs trace bench-exact bench-fast bench-fast-steady bench-sampled bench-sampled-eager
#     bench-fast-eager wide-graphs wide-graphs-bench wide
# Small results (logs, json, md) are packed into $OUT/results-<steps>.tgz at the end; the gzipped
# Chrome traces are left beside it.
set -uo pipefail
OUT=${OUT:-gpu-out}
W=/tmp/gpu-work
mkdir -p "$OUT" "$W"
# the working tree first; /tmp/site holds the wheels and the project's own metadata (its version, entry points)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
bench() { python3 -c "from benchmarks.cli import bench_app; bench_app()" "$@"; }
LIMIT=${LIMIT:-30}  # seconds per bench level: every level is bounded in time as well as count
GRAPH_BUDGET=${GRAPH_BUDGET:-20}  # seconds per batch size and path in the graphs steps
serve_bench() {  # NAME CONFIG [bench args]: 32 requests per level, baseline 16, c=1,4,16
  local name=$1 config=$2; shift 2
  bench --serve --config "$config" --num-requests 32 --baseline-requests 16 --concurrency 1,4,16 \
    --time-limit "$LIMIT" --no-progress --json "$W/bench-$name.json" --markdown "$W/bench-$name.md" "$@" \
    2>&1 | tee "$W/bench-$name.log" | tail -30
}
with() {  # SRC DST KEY=VALUE...: the deploy YAML with each STAGE.KEY (or KEY, for every stage) set to VALUE (YAML)
  python3 - "$@" <<'PY'
import sys, yaml
src, dst, *pairs = sys.argv[1:]
cfg = yaml.safe_load(open(src))
for pair in pairs:
    key, value = pair.split("=", 1)
    stage, _, field = key.rpartition(".")
    for name in [stage] if stage else ["thinker", "talker", "code2wav"]:
        cfg.setdefault(name, {})[field] = yaml.safe_load(value)
yaml.safe_dump(cfg, open(dst, "w"))
PY
}
wide_checkpoint() {  # /tmp/wide, built once per machine (3.9 GB of seeded weights)
  [ -d /tmp/wide ] || python3 -m benchmarks.gpu.wide_checkpoint /tmp/wide 2>&1 | tail -2
}
for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    setup)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --ignore-requires-python --target /tmp/site .
      nvidia-smi -L
      python3 -c "import torch, transformers, grpc; print(torch.__version__, transformers.__version__, grpc.__version__, torch.cuda.get_device_name())" ;;
    tests)
      OMNISTAGE_TEST_DEVICE=cuda OMNISTAGE_TEST_DIFFS="$W/wave-diffs.tsv" python3 -m pytest -q -rfs --tb=short -p no:cacheprovider \
        tests/test_device_copy.py tests/test_cuda_graphs.py tests/test_parity.py tests/test_multimodal_model.py tests/test_qwen2_5_omni.py tests/test_kv_pool.py tests/test_token_pool.py \
        2>&1 | tee "$W/tests.log" | tail -40 ;;
    graph-tests)  # the CUDA graph tests alone (graphs against the eager loop, exact-mode parity with graphs on)
      OMNISTAGE_TEST_DEVICE=cuda python3 -m pytest -q -rfs --tb=short -p no:cacheprovider tests/test_cuda_graphs.py 2>&1 | tee "$W/graph-tests.log" | tail -20 ;;
    graphs)  # the code predictor's loop, eager against its CUDA graphs, in one process
      for b in fast exact; do
        python3 -m benchmarks.gpu.code_predictor_graphs --batching $b --batches 1,2,4,8,16 --budget-s "$GRAPH_BUDGET" --json "$W/graphs-$b.json" \
          2>&1 | tee "$W/graphs-$b.log" | grep -v Warning
      done ;;
    trace)
      bench trace --out "$W/trace-tiny" --batching both --requests 2 ;;
    bench-exact)
      serve_bench cuda-exact deploy/examples/cuda.yaml ;;
    bench-fast)  # fast batching, the example's talker graphs on
      with deploy/examples/cuda.yaml /tmp/cuda-fast.yaml batching=fast
      serve_bench cuda-fast /tmp/cuda-fast.yaml ;;
    bench-fast-steady)  # fast + graphs, c=16 and 32 with 96 requests a level: the pipeline ratio with less of the
      # level in its ramp up and down (with 32 requests at c=16 much of it ran with fewer than 16 open)
      with deploy/examples/cuda.yaml /tmp/cuda-fast.yaml batching=fast
      LIMIT=40 serve_bench cuda-fast-steady /tmp/cuda-fast.yaml --concurrency 16,32 --num-requests 96 \
        --no-monolithic --no-inprocess --no-full-payload ;;
    bench-sampled)  # fast batching, the talker sampling (the HTTP default), its code predictor's sampled graphs on
      with deploy/examples/cuda.yaml /tmp/cuda-fast.yaml batching=fast
      serve_bench cuda-sampled /tmp/cuda-fast.yaml --sampled-speech ;;
    bench-sampled-eager)  # the same, the code predictor's loop eager (what the sampled graphs save)
      with deploy/examples/cuda.yaml /tmp/cuda-eager.yaml batching=fast talker.cuda_graphs=false
      serve_bench cuda-sampled-eager /tmp/cuda-eager.yaml --sampled-speech ;;
    bench-fast-eager)  # fast batching, the code predictor's loop eager (what the graphs save)
      with deploy/examples/cuda.yaml /tmp/cuda-eager.yaml batching=fast talker.cuda_graphs=false
      serve_bench cuda-eager /tmp/cuda-eager.yaml ;;
    wide-graphs)  # the code predictor's loop at the real widths (5 layers, 1024 wide, 16 groups), bfloat16
      wide_checkpoint
      python3 -m benchmarks.gpu.code_predictor_graphs --model /tmp/wide --dtype bfloat16 --batches 1,4,16 \
        --budget-s "$GRAPH_BUDGET" --json "$W/graphs-wide.json" 2>&1 | tee "$W/graphs-wide.log" | grep -v Warning ;;
    wide-graphs-bench)  # the real model's widths served in fast mode with the code predictor's CUDA graphs, bfloat16
      wide_checkpoint
      with deploy/examples/cuda.yaml /tmp/wide-graphs.yaml batching=fast dtype=bfloat16
      # no stage baselines: on this checkpoint they outlast a session's device time (2026-11-26)
      serve_bench wide-graphs /tmp/wide-graphs.yaml --model /tmp/wide --no-stages --baseline-requests 8 ;;
    wide)  # the real model's widths, a few layers (benchmarks/gpu/wide_checkpoint.py), bfloat16
      wide_checkpoint
      bench trace --model /tmp/wide --dtype bfloat16 --out "$W/trace-wide" --batching both --requests 2
      with deploy/examples/cuda.yaml /tmp/wide-exact.yaml dtype=bfloat16
      with /tmp/wide-exact.yaml /tmp/wide-fast.yaml batching=fast
      LIMIT=40 serve_bench wide-exact /tmp/wide-exact.yaml --model /tmp/wide
      LIMIT=40 serve_bench wide-fast /tmp/wide-fast.yaml --model /tmp/wide ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
for d in "$W"/trace-*; do [ -d "$d" ] && for f in "$d"/*.json.gz; do cp "$f" "$OUT/$(basename "$d")-$(basename "$f")"; done; done
tar czf "$OUT/results-$(IFS=-; echo "$*").tgz" -C "$W" --exclude='*.json.gz' .
ls -la "$OUT"
