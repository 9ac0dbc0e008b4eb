#!/usr/bin/env bash
# On the GPU machine: the fast llama engine's attention, its own kernel against cuDNN's, in one
# run on one GPU. First the GPU tests that hold both kernels to the CPU engine's tolerance, then
# the attention alone (bench/gpu/attention_bench.cc), then the 1B-shape forward with each kernel
# over a bf16 cache (bench/gpu/llama_prefill_bench.cc; the bridge off and on with cuDNN's).
#
# Carry: .devkit/lib (scripts/devkit.sh), build/hetero_gpu_tests,
# build/hetero_gpu_attention_bench, build/hetero_gpu_llama_prefill_bench. cuDNN is the machine's
# own (its PyTorch's wheel; devkit_libs finds it). Env: T (token counts), REPEAT, REV, TESTS=0
# to skip the tests. Writes $OUT/attention.jsonl, $OUT/forward.jsonl and $OUT/*.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT:-out/attention-device}
mkdir -p "$OUT_DIR"
T=${T:-8192,32768,131072}
REPEAT=${REPEAT:-3}
REV=${REV:-$(cat .devkit/REVISION 2>/dev/null || echo unknown)}
BINS=(build/hetero_gpu_tests build/hetero_gpu_attention_bench build/hetero_gpu_llama_prefill_bench)
source bench/gpu/devkit_libs.sh
devkit_libs /tmp/hetero-lib "${BINS[@]}" >/dev/null
for b in "${BINS[@]}"; do ldd "$b" | grep -E 'cudnn|not found' | sed "s|^|$b: |"; done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/env.txt"
rc=0
if [[ ${TESTS:-1} != 0 ]]; then
  echo "== GPU tests: the llama engine, both attention kernels"
  build/hetero_gpu_tests --gtest_filter='*LlamaCuda*' >"$OUT_DIR/gpu_tests.log" 2>&1 || rc=1
  grep -E '^\[  (FAILED|PASSED|SKIPPED) |auto over|attention .* layer 2|rel rms' \
    "$OUT_DIR/gpu_tests.log" | grep -v 'layer [01] ' | tail -40
fi
echo "== attention alone"
build/hetero_gpu_attention_bench --t "$T" --repeat "$REPEAT" --rev "$REV" \
  >"$OUT_DIR/attention.jsonl" 2>"$OUT_DIR/attention.log" || rc=1
cat "$OUT_DIR/attention.log"
echo "== the 1B forward, bf16 cache, each kernel"
for att in own cudnn; do
  modes=off
  [[ $att == cudnn ]] && modes=off,on
  build/hetero_gpu_llama_prefill_bench --tokens "$T" --kv bf16 --attention $att --modes $modes \
    --repeat "$REPEAT" --rev "$REV" >>"$OUT_DIR/forward.jsonl" 2>"$OUT_DIR/forward-$att.log" || rc=1
  cat "$OUT_DIR/forward-$att.log"
done
echo "rc=$rc"
exit $rc
