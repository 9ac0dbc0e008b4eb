#!/usr/bin/env bash
# On the GPU machine: the fast llama forward's drift from the exact one (the decoder's
# arithmetic) by position, past 128K tokens (bench/gpu/llama_prefill_bench.cc --drift).
#
# Carry: .devkit/lib (scripts/devkit.sh), build/hetero_gpu_llama_prefill_bench. Env: T (default
# 196608), LAYERS (4), SHAPE (smollm2: the default model's widths), AT (window starts; default
# 0,65536,131072,163840,T-1024), KV (bf16), ATTENTION (auto), REV. Writes $OUT/drift.jsonl and
# $OUT/drift.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT:-out/drift-device}
mkdir -p "$OUT_DIR"
T=${T:-196608}
AT=${AT:-0,65536,131072,163840,$((T - 1024))}
source bench/gpu/devkit_libs.sh
devkit_libs /tmp/hetero-lib build/hetero_gpu_llama_prefill_bench >/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/env.txt"
build/hetero_gpu_llama_prefill_bench --drift --tokens "$T" --at "$AT" --window 1024 \
  --shape "${SHAPE:-smollm2}" --layers "${LAYERS:-4}" --kv "${KV:-bf16}" \
  --attention "${ATTENTION:-auto}" --rev "${REV:-$(cat .devkit/REVISION 2>/dev/null || echo unknown)}" \
  >"$OUT_DIR/drift.jsonl" 2>"$OUT_DIR/drift.log"
rc=$?
cat "$OUT_DIR/drift.log"
echo "rc=$rc"
exit $rc
