#!/usr/bin/env bash
# On the GPU machine: DeepSeek-V4 in the checkpoint's own precision, one GPU (issue 14's
# single-GPU part). Every GPU test; the layer bench at Flash shapes with the experts requantized
# to FP8 and in the official precision, in the same run; then a Flash-width official checkpoint
# written to local disk by one process and streamed onto the GPU by another, with the host's
# peak RSS.
#
# Carry: .devkit/lib, build/hetero_gpu_tests, build/hetero_gpu_dsv4_layer_bench,
# build/hetero_gpu_dsv4_checkpoint_load_bench. Env: REV (the revision for the JSON lines),
# LAYERS (bench layers, 8), T (8192,32768), CKPT_LAYERS (3). Writes $OUT/{env.txt,
# gpu_tests.log,layer.jsonl,layer.err,load.jsonl,load.err}.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT:-out/checkpoint-device}
mkdir -p "$OUT_DIR"
source bench/gpu/devkit_libs.sh
devkit_libs /tmp/hetero-lib build/hetero_gpu_tests build/hetero_gpu_dsv4_layer_bench \
  build/hetero_gpu_dsv4_checkpoint_load_bench || exit 1
REV=${REV:-unknown}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT_DIR/env.txt"
rc=0

echo "== GPU tests"
timeout 300 build/hetero_gpu_tests >"$OUT_DIR/gpu_tests.log" 2>&1 || rc=1
grep -E "^\[  (PASSED|FAILED) |tests ran|checkpoint (gemms|engine)|formats" "$OUT_DIR/gpu_tests.log"

echo "== layer bench, Flash shapes"
for w in fp8 checkpoint; do
  timeout 240 build/hetero_gpu_dsv4_layer_bench --weights "$w" --layers "${LAYERS:-8}" \
    --t "${T:-8192,32768}" --warmup 1 --repeats 2 --rev "$REV" \
    >>"$OUT_DIR/layer.jsonl" 2>>"$OUT_DIR/layer.err" || rc=1
done
tail -n 12 "$OUT_DIR/layer.err"

echo "== Flash-width checkpoint: write, then stream"
ck=/tmp/hetero-flash-ckpt
rm -rf "$ck"
timeout 240 build/hetero_gpu_dsv4_checkpoint_load_bench --write "$ck" --shape flash \
  --layers "${CKPT_LAYERS:-3}" 2>>"$OUT_DIR/load.err" || rc=1
du -sh "$ck" | tee -a "$OUT_DIR/load.err"
timeout 240 build/hetero_gpu_dsv4_checkpoint_load_bench --load "$ck" --tokens 8192 \
  >>"$OUT_DIR/load.jsonl" 2>>"$OUT_DIR/load.err" || rc=1
cat "$OUT_DIR/load.jsonl" "$OUT_DIR/load.err"
rm -rf "$ck"
exit $rc
