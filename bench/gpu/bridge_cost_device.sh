#!/usr/bin/env bash
# On the GPU machine (two GPUs of one host for the second placement): what the bridge costs the
# forward with its cache program on the forward's GPU and on a GPU of its own (--program-device),
# for DeepSeek-V4 at Flash's layer shapes in the checkpoint's precision and for the llama 1B
# shapes (bf16 cache, cuDNN attention). Each placement is one bench invocation that times the
# forward alone ("off") and with the tap, the exact program and the framing behind it ("on"; for
# llama also "tagged", its frames tagged as a prefill host with the stack's secret sends them) at
# every T, so each cost is a ratio within one invocation; "on-engine" is "on" with the tap's
# copies (over NVLink where the program has its own GPU) on the engine's stream instead of the
# capture's. Every GPU test first (GPU_TESTS=1): on two GPUs the suite's two-GPU tests run too. Then the host's share of one llama segment
# (hetero_wire_bench, 268 MB: framing and verifying, untagged and tagged).
#
# Carry: .devkit/lib, build/hetero_gpu_tests, build/hetero_gpu_dsv4_layer_bench,
# build/hetero_gpu_llama_prefill_bench, build/hetero_wire_bench.
# Env: REV (names the output), T (8192,32768,131072), LAYERS (DeepSeek-V4 layers; default 16
# where a GPU holds ≥ 120 GiB, else 10), CHUNK (32768), REPEATS (3), PLACEMENTS (-1,1: the
# engine's GPU, then GPU 1; a placement the machine lacks is reported and skipped), LLAMA (1),
# BIN (build: the benches' directory; another build's, carried, measures that build: NAME then
# tells the outputs apart).
# Writes $OUT/{gpu_tests.log,wire-$NAME.jsonl,dsv4-$NAME-p*.{jsonl,txt},llama-$NAME-p*.{jsonl,txt}}.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT:-out/bridge-cost}
mkdir -p "$OUT_DIR"
REV=${REV:-unknown}
source bench/gpu/devkit_libs.sh
BIN=${BIN:-build}
NAME=${NAME:-$REV}
devkit_libs /tmp/hetero-lib build/hetero_gpu_tests "$BIN/hetero_gpu_dsv4_layer_bench" \
  "$BIN/hetero_gpu_llama_prefill_bench" || exit 1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
layers=${LAYERS:-$((mib >= 122880 ? 16 : 10))}
rc=0
if [[ ${GPU_TESTS:-1} == 1 ]]; then
  timeout 360 build/hetero_gpu_tests >"$OUT_DIR/gpu_tests.log" 2>&1 || rc=1
  grep -E "^\[  FAILED|^\[  PASSED|^\[  SKIPPED|tests ran" "$OUT_DIR/gpu_tests.log"
fi
if [[ -x "$BIN/hetero_wire_bench" ]]; then
  echo "== $NAME: one llama 1B segment on this host ($(nproc) cores)"
  timeout 60 "$BIN/hetero_wire_bench" --repeat 5 --rev "$REV" | tee "$OUT_DIR/wire-$NAME.jsonl" ||
    rc=1
fi
for p in $(echo "${PLACEMENTS:--1,1}" | tr ',' ' '); do
  if ((p >= gpus)); then
    echo "== placement $p: this machine has $gpus GPU(s); skipped"
    continue
  fi
  flag=$([[ $p == -1 ]] || echo "--program-device $p")
  name=$NAME-p${p/-1/engine}
  timeout 360 "$BIN/hetero_gpu_dsv4_layer_bench" --weights checkpoint --layers "$layers" \
    --t "${T:-8192,32768,131072}" --chunk "${CHUNK:-32768}" --repeats "${REPEATS:-3}" --warmup 1 \
    --bridge off,on-engine,on $flag --rev "$REV" >"$OUT_DIR/dsv4-$name.jsonl" \
    2>"$OUT_DIR/dsv4-$name.txt" || rc=1
  echo "== $NAME: DeepSeek-V4, $layers layers, program on ${name##*-p}"
  grep -E "^ +[0-9]+ |bridge|GB" "$OUT_DIR/dsv4-$name.txt" | tail -16
  if [[ ${LLAMA:-1} == 1 ]]; then
    timeout 260 "$BIN/hetero_gpu_llama_prefill_bench" --tokens "${T:-8192,32768,131072}" \
      --modes off,on-engine,on,tagged --kv bf16 --attention cudnn --repeat "${REPEATS:-3}" $flag \
      --rev "$REV" >"$OUT_DIR/llama-$name.jsonl" 2>"$OUT_DIR/llama-$name.txt" || rc=1
    echo "== $NAME: llama 1B, program on ${name##*-p}"
    tail -12 "$OUT_DIR/llama-$name.txt"
  fi
done
exit $rc
