#!/usr/bin/env bash
# On the GPU machine: where DeepSeek-V4's forward spends its time, at Flash's layer shapes in the
# checkpoint's precision (FP8 projections, FP4 experts; random weights drawn on the device), and
# against a base binary in the same run. Every GPU test first (GPU_TESTS=1), then the layer bench
# with --phases for build/ and for $BASE (another build's hetero_gpu_dsv4_layer_bench, carried:
# e.g. out/base/ built at the revision before a change; a comma-separated list runs each, named
# base-<directory name> after the first, "base"), with WIDEN=1 build/ again with the
# experts widened to FP8 at load (--widen-experts at-load; named $REV-at-load), then (NCU=1) one kernel-time summary of
# a 3-layer, 8,192-token prefill under Nsight Compute (one metric: each kernel's duration), then
# (DETAIL) Nsight Compute's detailed sections (warp states, scheduler, memory, source counters)
# for the kernels named: DETAIL="index:index_select:1,segments:segments_kernel:2" profiles the
# first launch of index_select and the first two of segments_kernel (regular expressions) into
# $OUT/ncu-index.txt and $OUT/ncu-segments.txt.
#
# Carry: .devkit/lib, build/hetero_gpu_tests, build/hetero_gpu_dsv4_layer_bench[, the base's].
# Env: REV (names the output), BASE (a directory holding the base binary), T (8192,32768,131072),
# LAYERS (8), CHUNK (32768), REPEATS (2), WIDEN (0), GEMMS (empty: the default routed-expert
# kernel; "per-expert,grouped,w4a8": each, named $REV-<kernel>), BRIDGE (off; "off,on" also runs each T with
# the bridge behind the forward: its cost and wire bytes), PHASES (1: --phases), W4A8_BENCH (0; 1
# first runs the routed-expert GEMMs alone, hetero_gpu_w4a8_bench at $W4A8_TOKENS tokens, default
# 8192,32768, carried too: $OUT/w4a8-gemm.jsonl), W4A8_TILES (empty; e.g. "128x128,64x256:p": each
# GEMMS kernel that runs W4A8 (auto, w4a8) once per W4A8 kernel tile, ":p" persistent, a block a
# multiprocessor; named $REV-<kernel>-<tile>).
# Writes $OUT/{gpu_tests.log,layer-*.jsonl,layer-*.txt,ncu.txt}.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT:-out/dsv4-phases}
mkdir -p "$OUT_DIR"
REV=${REV:-unknown}
source bench/gpu/devkit_libs.sh
bins=(build/hetero_gpu_tests build/hetero_gpu_dsv4_layer_bench)
[[ ${W4A8_BENCH:-0} == 1 ]] && bins+=(build/hetero_gpu_w4a8_bench)
for b in ${BASE:+${BASE//,/ }}; do bins+=("$b/hetero_gpu_dsv4_layer_bench"); done
devkit_libs /tmp/hetero-lib "${bins[@]}" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
rc=0
if [[ ${GPU_TESTS:-1} == 1 ]]; then
  timeout 300 build/hetero_gpu_tests >"$OUT_DIR/gpu_tests.log" 2>&1 || rc=1
  grep -E "attn \]|index \]|^\[  FAILED|^\[  PASSED|^\[  SKIPPED|tests ran" "$OUT_DIR/gpu_tests.log"
fi
if [[ ${W4A8_BENCH:-0} == 1 ]]; then
  timeout 240 build/hetero_gpu_w4a8_bench --tokens "${W4A8_TOKENS:-8192,32768}" --repeat 5 --rev "$REV" \
    >"$OUT_DIR/w4a8-gemm.jsonl" 2>"$OUT_DIR/w4a8-gemm.txt" || rc=1
  echo "== w4a8 GEMMs (ms, TFLOP/s, against the best widened path)"
  cat "$OUT_DIR/w4a8-gemm.txt"
  python3 -c 'import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    print(d["T"], d["gemm"], d["kernel"], d["ms_median"], d["tflops"], d["vs_widened_best"])' \
    "$OUT_DIR/w4a8-gemm.jsonl"
fi
run_bench() {  # name binary_dir [more flags]
  timeout 200 "$2/hetero_gpu_dsv4_layer_bench" "${@:3}" --weights checkpoint --layers "${LAYERS:-8}" \
    --t "${T:-8192,32768,131072}" --chunk "${CHUNK:-32768}" --repeats "${REPEATS:-2}" --warmup 1 \
    $([[ ${PHASES:-1} == 1 ]] && echo --phases) --bridge "${BRIDGE:-off}" --rev "$1" \
    >"$OUT_DIR/layer-$1.jsonl" 2>"$OUT_DIR/layer-$1.txt" || rc=1
  echo "== $1"
  grep -E "phase|^ +[0-9]+ " "$OUT_DIR/layer-$1.txt"
}
first=1
for b in ${BASE:+${BASE//,/ }}; do
  run_bench "base$([[ $first == 1 ]] || echo "-${b##*/}")" "$b"
  first=0
done
if [[ -n ${GEMMS:-} ]]; then  # each routed-expert kernel in turn, in this run: $REV-<kernel>
  for g in ${GEMMS//,/ }; do
    if [[ -n ${W4A8_TILES:-} && ($g == w4a8 || $g == auto) ]]; then
      for tile in ${W4A8_TILES//,/ }; do
        run_bench "$REV-$g-${tile/:/-}" build --expert-gemm "$g" --w4a8-tile "${tile%:p}" \
          $([[ $tile == *:p ]] && echo --w4a8-persistent)
      done
    else
      run_bench "$REV-$g" build --expert-gemm "$g"
    fi
    # w4a8 runs FP4 experts: never widened at load
    [[ ${WIDEN:-0} == 1 && $g != w4a8 ]] &&
      run_bench "$REV-$g-at-load" build --expert-gemm "$g" --widen-experts at-load
  done
else
  run_bench "$REV" build
  [[ ${WIDEN:-0} == 1 ]] && run_bench "$REV-at-load" build --widen-experts at-load
fi
if [[ ${NCU:-0} == 1 ]]; then
  timeout 240 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
    build/hetero_gpu_dsv4_layer_bench --weights checkpoint --layers 3 --t 8192 --chunk 8192 \
    --repeats 1 --warmup 0 --bridge off >"$OUT_DIR/ncu.txt" 2>&1
  echo "ncu rc=$?"
fi
for d in ${DETAIL:+${DETAIL//,/ }}; do  # name:regex:count
  IFS=: read -r name regex count <<<"$d"
  timeout 120 ncu --clock-control none --kernel-name regex:"$regex" --launch-count "$count" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    build/hetero_gpu_dsv4_layer_bench --weights checkpoint --layers 3 --t 8192 --chunk 8192 \
    --repeats 1 --warmup 0 --bridge off >"$OUT_DIR/ncu-$name.txt" 2>&1
  echo "ncu $name rc=$?"
done
exit $rc
