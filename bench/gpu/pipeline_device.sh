#!/usr/bin/env bash
# On the GPU machine: DeepSeek-V4's layer pipeline with the bridge behind it (issue 14), on
# whatever GPUs the machine has. Every GPU test; then the served prefill host on a small official
# DeepSeek-V4 checkpoint (FP8 projections, FP4 experts) with one stage (--gpus 0) and with the
# pipeline (--gpus 0,0 on one GPU, 0,1 where there are two): the same request must stream the
# same bytes, complete, and GET /health must report each GPU's memory; --gpus naming a GPU that
# is not there, and --program-device beside several stages, must be refused at start. Last, the
# pipeline bench at Flash shapes, bridge off and on, one stage and two.
#
# Carry: .devkit/lib, build/hetero, build/hetero_gpu_tests, build/hetero_gpu_dsv4_pipeline_bench,
# out/dsv4-gpu-model (made here by: bench/gpu/pipeline_device.sh --make-model). Env: REV,
# LAYERS (8), T (8192,32768), DECODER_STEP (2048: the decoder's calls), CHUNKS (2048: the engine
# chunks to bench, a list: each a run, the decoder's calls grouped up to it), GPU_TESTS (1: run
# them), SERVED (1: run the served and refusal checks). Writes $OUT/{env.txt,gpu_tests.log,
# served.jsonl,prefill-*.log,pipeline.jsonl,pipeline.err}.
set -uo pipefail
cd "$(dirname "$0")/../.."
MODEL_DIR=out/dsv4-gpu-model
if [[ ${1:-} == --make-model ]]; then  # here, not on the GPU machine: 4 layers at hidden 128
  rm -rf "$MODEL_DIR" /tmp/dsv4-gpu-model.tmp
  PYTHONPATH=python .venv/bin/python -m hetero_mlx tiny-dsv4 --tokenizer models/smollm2-135m-instruct \
    --out /tmp/dsv4-gpu-model.tmp --variants fp8,bf16 --layers 4 --hidden 128 --mtp-layers 0 \
    >/dev/null &&
    PYTHONPATH=python .venv/bin/python -m hetero_mlx export --model /tmp/dsv4-gpu-model.tmp/bf16 \
      --out "$MODEL_DIR/weights" >/dev/null 2>&1 &&
    mv /tmp/dsv4-gpu-model.tmp/fp8 "$MODEL_DIR/model" && rm -rf /tmp/dsv4-gpu-model.tmp &&
    du -sh "$MODEL_DIR"
  exit $?
fi
OUT_DIR=${OUT:-out/pipeline-device}
mkdir -p "$OUT_DIR"
source bench/gpu/devkit_libs.sh
devkit_libs /tmp/hetero-lib build/hetero build/hetero_gpu_tests \
  build/hetero_gpu_dsv4_pipeline_bench || exit 1
export NCCL_NVLS_ENABLE=0
REV=${REV:-unknown}
CHUNKS=${CHUNKS:-2048}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT_DIR/env.txt"
ngpu=$(nvidia-smi -L | wc -l)
rc=0

if [[ ${GPU_TESTS:-1} == 1 ]]; then
  echo "== GPU tests"
  timeout 400 build/hetero_gpu_tests >"$OUT_DIR/gpu_tests.log" 2>&1 || rc=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran|pipeline \]" "$OUT_DIR/gpu_tests.log" | sort | uniq -c
fi

if [[ ${SERVED:-1} == 1 ]]; then
echo "== served: one stage against the pipeline"
pipeline=0,0
((ngpu > 1)) && pipeline=0,1
port=18020
for w in checkpoint bf16; do
  for gpus in 0 "$pipeline"; do
    log="$OUT_DIR/prefill-$w-${gpus//,/_}.log"
    timeout 300 build/hetero prefill --model "$MODEL_DIR/model" --weights "$MODEL_DIR/weights" \
      --backend cuda --arith fast --weight-dtype "$w" --gpus "$gpus" --port $port >"$log" 2>&1 &
    pid=$!
    for _ in $(seq 200); do curl -sf localhost:$port/health >/dev/null && break; sleep 0.3; done
    python3 - "$port" "$OUT_DIR/served.jsonl" "$w" "$gpus" <<'PY' || rc=1
import hashlib, json, sys, time, urllib.request
port, out, weights, gpus = sys.argv[1:5]
health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health"))
calls = [256, 256, 3, 1, 256, 228]  # a decoder's schedule: long calls and tokenwise ones
ids = [(i * 7919) % 49000 + 1 for i in range(sum(calls))]
body = json.dumps({"ids": ids, "fingerprint": health["fingerprint"],
                   "decoder_calls": calls}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/prefill", data=body,
                             headers={"Content-Type": "application/json"})
t = time.perf_counter()
with urllib.request.urlopen(req, timeout=120) as r:
    status, data = r.status, r.read()
secs = time.perf_counter() - t
after = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health"))
row = {"weights": weights, "gpus": gpus, "tokens": len(ids), "status": status,
       "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "seconds": round(secs, 3),
       "manifest_complete": b'"kind":"manifest"' in data and b'"complete":true' in data,
       "gpu_memory": after.get("gpu_memory", [])}
print(json.dumps(row))
with open(out, "a") as f:
    f.write(json.dumps(row) + "\n")
g = row["gpu_memory"]
sys.exit(0 if status == 200 and row["manifest_complete"] and g and
         all(x["weights_bytes"] > 0 and x["capture_bytes"] > 0 for x in g) else 1)
PY
    kill $pid 2>/dev/null
    wait $pid 2>/dev/null
  done
done
python3 - "$OUT_DIR/served.jsonl" <<'PY' || rc=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ok = True
for w in ("checkpoint", "bf16"):
    got = {r["gpus"]: r["sha256"] for r in rows if r["weights"] == w}
    same = len(got) == 2 and len(set(got.values())) == 1
    ok &= same
    print(f"{w}: one stage and the pipeline stream the same bytes: {same} {got}")
sys.exit(0 if ok else 1)
PY

echo "== refusals at start"
for args in "--gpus 0,$ngpu" "--gpus 0,0 --program-device 0"; do
  # shellcheck disable=SC2086
  timeout 60 build/hetero prefill --model "$MODEL_DIR/model" --weights "$MODEL_DIR/weights" \
    --backend cuda --arith fast $args --port $port >"$OUT_DIR/refusal.log" 2>&1
  code=$?
  echo "$args -> exit $code: $(grep -v '^\s*$' "$OUT_DIR/refusal.log" | tail -1)"
  ((code != 0 && code != 124)) || rc=1
done

fi

echo "== pipeline bench, Flash shapes, bridge off and on"
for devices in 0 "$pipeline"; do
  single=--no-single
  [[ $devices == *,* ]] && single=""
  for chunk in ${CHUNKS//,/ }; do
    echo "devices $devices, chunk $chunk" >>"$OUT_DIR/pipeline.err"
    # shellcheck disable=SC2086
    timeout 400 build/hetero_gpu_dsv4_pipeline_bench --devices "$devices" --layers "${LAYERS:-8}" \
      --weights checkpoint --t "${T:-8192,32768}" --decoder-step "${DECODER_STEP:-2048}" \
      --chunk "$chunk" --repeats 2 --bridge off,on --rev "$REV" $single \
      >>"$OUT_DIR/pipeline.jsonl" 2>>"$OUT_DIR/pipeline.err" || rc=1
  done
done
cat "$OUT_DIR/pipeline.err"
echo "rc=$rc"
exit $rc
