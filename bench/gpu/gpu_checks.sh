#!/usr/bin/env bash
# On the GPU machine: every GPU test, then memory admission on the served path. `hetero prefill
# --backend cuda --memory-floor refuse` under a device-memory budget gets a prompt too long for
# it: it must answer HTTP 507 with a JSON error before any byte streams. Then a short prompt on the
# same host must stream to a complete manifest, and GET /health must report the GPU's memory
# (weights within the budget, the capture's slots, the device's free and total). Then the memory
# floor (the default, --memory-floor seal) under the same budget: the long prompt streams the
# longest prefix of whole chunks that fits, sealed by a manifest that says so, and the host
# serves the short prompt whole after it.
#
# Carry: .devkit/lib (scripts/devkit.sh), build/hetero, build/hetero_gpu_tests, out/gpu-model
# (made here by: bench/gpu/gpu_checks.sh --make-model). Writes $OUT/gpu_tests.log and
# $OUT/admission.jsonl.
set -uo pipefail
cd "$(dirname "$0")/../.."
MODEL_DIR=out/gpu-model
if [[ ${1:-} == --make-model ]]; then  # here, not on the GPU machine: a tiny llama and its export
  rm -rf "$MODEL_DIR"
  PYTHONPATH=python .venv/bin/python -m hetero_mlx tiny-llama --tokenizer models/smollm2-135m-instruct \
    --out "$MODEL_DIR/model" --layers 2 --hidden 256 --heads 4 --kv-heads 2 --head-dim 64 \
    --intermediate 512 >/dev/null &&
    PYTHONPATH=python .venv/bin/python -m hetero_mlx export --model "$MODEL_DIR/model" \
      --out "$MODEL_DIR/weights" >/dev/null &&
    rm -f "$MODEL_DIR"/model/tokenizer* "$MODEL_DIR"/model/special_tokens_map.json &&
    du -sh "$MODEL_DIR"
  exit $?
fi
OUT_DIR=${OUT:-out/gpu-checks}
mkdir -p "$OUT_DIR"
source bench/gpu/devkit_libs.sh
devkit_libs /tmp/hetero-lib build/hetero build/hetero_gpu_tests || exit 1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT_DIR/env.txt"

echo "== GPU tests"
build/hetero_gpu_tests 2>&1 | tee "$OUT_DIR/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== memory admission, served"
# The smallest of these budgets under which a short prompt runs; a 1M-token prompt needs ~1 GB of
# cache alone with this model, more than any of them.
port=18010
adm_rc=1
for budget in ${BUDGETS_MB:-64 128 256 512}; do
  build/hetero prefill --model "$MODEL_DIR/model" --weights "$MODEL_DIR/weights" --backend cuda \
    --device-memory-budget-mb "$budget" --memory-floor refuse --port $port --chunk 512 \
    >"$OUT_DIR/prefill.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do curl -sf localhost:$port/health >/dev/null && break; sleep 0.3; done
  python3 - "$port" "$OUT_DIR/admission.jsonl" "$budget" <<'PY'
import json, sys, time, urllib.error, urllib.request
port, out, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health"))
def post(n):
    body = json.dumps({"ids": [(i * 7) % 500 + 1 for i in range(n)],
                       "fingerprint": health["fingerprint"]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/prefill", data=body,
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            status, data = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read()
    return status, data, time.perf_counter() - t
rows = []
for n in (300, 1_000_000, 300, 1_000_000, 300):
    status, data, secs = post(n)
    row = {"budget_mb": budget, "tokens": n, "status": status, "seconds": round(secs, 3)}
    if status == 200:
        row["manifest_complete"] = b'"kind":"manifest"' in data and b'"complete":true' in data
        row["bytes"] = len(data)
    else:
        row["body"] = json.loads(data)
    rows.append(row)
    print(json.dumps(row))
    if n == 300 and status != 200 and len(rows) == 1:
        print(f"budget {budget} MiB is too small for the short prompt: next budget")
        sys.exit(2)
with open(out, "a") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
ok = all((r["status"] == 507 and r["body"]["error"]["code"] == "resource_exhausted")
         if r["tokens"] > 300 else (r["status"] == 200 and r["manifest_complete"]) for r in rows)
# /health reports the GPU's memory: the engine's weights within the budget, the capture's slots.
gpu = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health")).get("gpu_memory", [])
print("gpu_memory:", json.dumps(gpu))
with open(out, "a") as f:
    f.write(json.dumps({"budget_mb": budget, "gpu_memory": gpu}) + "\n")
g = gpu[0] if gpu else {}
ok = ok and g.get("weights_bytes", 0) > 0 and g.get("capture_bytes", 0) > 0 and \
    0 < g["weights_bytes"] + g["state_and_activations_bytes"] <= budget << 20 and \
    g.get("total_bytes", 0) > g.get("free_bytes", -1) >= 0
print("admission:", "ok" if ok else "FAILED")
sys.exit(0 if ok else 1)
PY
  adm_rc=$?
  kill $pid; wait $pid 2>/dev/null
  ((adm_rc == 2)) || break
done
tail -5 "$OUT_DIR/prefill.log"

echo "== the memory floor, served (budget $budget MiB)"
build/hetero prefill --model "$MODEL_DIR/model" --weights "$MODEL_DIR/weights" --backend cuda \
  --device-memory-budget-mb "$budget" --port $port --chunk 512 >"$OUT_DIR/prefill-seal.log" 2>&1 &
pid=$!
for _ in $(seq 100); do curl -sf localhost:$port/health >/dev/null && break; sleep 0.3; done
python3 - "$port" "$OUT_DIR/admission.jsonl" "$budget" <<'PY'
import json, sys, time, urllib.request
port, out, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health"))
ok = True
for n in (1_000_000, 300):
    body = json.dumps({"ids": [(i * 7) % 500 + 1 for i in range(n)],
                       "fingerprint": health["fingerprint"]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/prefill", data=body,
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        status, data = r.status, r.read()
    secs = time.perf_counter() - t
    # The manifest is the last frame: its JSON header follows the last '"kind":"manifest"'.
    at = data.rfind(b'{"', 0, data.rfind(b'"kind":"manifest"') + 1)
    manifest = json.JSONDecoder().raw_decode(data[at:].decode(errors="replace"))[0]
    row = {"budget_mb": budget, "memory_floor": "seal", "tokens": n, "status": status,
           "seconds": round(secs, 3), "bytes": len(data), "manifest": manifest}
    print(json.dumps(row))
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    covered = manifest.get("covered_tokens", -1)
    if n == 300:
        ok = ok and status == 200 and manifest.get("complete") is True and covered == 300
    else:
        ok = ok and status == 200 and manifest.get("complete") is False and \
            0 < covered < n and covered % 512 == 0 and \
            manifest.get("reason", "").startswith(f"sealed at the memory floor: {covered} of {n}")
print("memory floor:", "ok" if ok else "FAILED")
sys.exit(0 if ok else 1)
PY
floor_rc=$?
kill $pid; wait $pid 2>/dev/null
grep -m2 "sealed at the memory floor" "$OUT_DIR/prefill-seal.log"
echo "gpu tests rc=$tests_rc admission rc=$adm_rc memory floor rc=$floor_rc"
exit $((tests_rc || adm_rc || floor_rc))
