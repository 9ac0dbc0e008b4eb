#!/usr/bin/env bash
# On the GPU machine: DeepSeek-V4 bridged from the GPU through the real decoder. The pinned
# decoder (mlx-vlm on MLX's CPU backend, the machine's cores) and its seam run there from carried
# wheels; a small DeepSeek-V4 is drawn there (`hetero_mlx tiny-dsv4`: the official FP8 layout
# and the decoder's own `native` variant; the shapes are too large to carry); then `hetero
# verify` for each chat prompt with the prefill on the GPU in checkpoint precision, as one stage
# (--gpus 0) and as a two-stage pipeline (--gpus 0,0; 0,1 where there are two GPUs): every cache
# array against the decoder's own, the continuation, and the decoder's own token accounting.
#
# Here first: bench/gpu/dsv4_verify_device.sh --wheels (fills .whl/ with the decoder's wheels for
# the machine's Python 3.12; what the machine lacks of their dependencies, nothing it has).
# Carry: .whl, .devkit/lib, .devkit/model, build/hetero. Env: REV, STAGES ("one pipeline": which
# of the two runs), MIN_COSINE (0.99; fast arithmetic is judged by the arrays' cosine, so the
# per-element ULP bound is off: MAX_ULP 65536). Writes $OUT/{env.txt,make.log,verify.jsonl} and a
# verify-*.err for a verify that said anything on stderr.
# With LONG_SIZES (e.g. 131072,1048576) it runs no verify: it serves the model (`hetero up`, the
# prefill as above on one GPU) and sends one fresh bridged prompt of about each size through the
# front door (bench/memory.py --no-native: the verdict, the decoder's own count of reused prompt
# tokens, peak RSS of each process, time to first token) into $OUT/memory-<rev>.jsonl and
# $OUT/long.log. YARN (16) is the tiny model's YaRN factor: 16 gives Flash's 1,048,576 positions,
# 32 gives 2,097,152.
# With WARM_TURNS (bench/warm_turns.py flags, e.g. "--turns 6 --no-native") it runs a growing
# conversation through the served stack instead, the prefill as above on one GPU: each later
# turn bridged by its tail from the prefill host's checkpoints ($OUT/warm-turns-*.jsonl,
# $OUT/warm.log).
set -uo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(mlx mlx-cpu mlx-lm mlx-vlm fastapi starlette uvicorn pydantic pydantic_core annotated-types
        typing-inspection python-multipart websockets annotated-doc opentelemetry-api mlx-audio
        cryptography cffi pycparser)
if [[ ${1:-} == --wheels ]]; then
  rm -rf .whl && mkdir -p .whl
  source scripts/pinned_wheels.sh
  pinned_wheels .whl "${WHEELS[@]}" &&
    du -sh .whl
  exit $?
fi
OUT_DIR=${OUT:-out/dsv4-verify-device}
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/python
# The decoder's interpreter: the machine's python3 plus the carried wheels. hetero sets its
# children's PYTHONPATH to python/ (the seam), so the site dir is appended, not replaced.
PY=/tmp/dsv4-verify-python
cat >$PY <<SH
#!/usr/bin/env bash
export PYTHONPATH="\${PYTHONPATH:+\$PYTHONPATH:}/tmp/site"
exec $(command -v python3) "\$@"
SH
chmod +x $PY
source bench/gpu/devkit_libs.sh
devkit_libs /tmp/hetero-lib build/hetero || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT_DIR/env.txt"
python3 -c 'import mlx.core as mx, mlx_vlm; print("mlx", mx.__version__, "mlx-vlm", mlx_vlm.__version__)' |
  tee -a "$OUT_DIR/env.txt"
ngpu=$(nvidia-smi -L | wc -l)
pipeline=0,0
((ngpu > 1)) && pipeline=0,1
# The seam imports the decoder's server: everything it needs must be there before any verify.
$PY -c 'import hetero_mlx.vlm_serve' || exit 1
M=/tmp/dsv4-verify
rm -rf $M
timeout 600 python3 -m hetero_mlx tiny-dsv4 --tokenizer .devkit/model --out $M --variants fp8,native \
  --layers 4 --hidden 128 --mtp-layers 0 --yarn-factor "${YARN:-16}" >"$OUT_DIR/make.log" 2>&1 ||
  { tail "$OUT_DIR/make.log"; exit 1; }
if [[ -n ${LONG_SIZES:-} ]]; then
  (cd bench && HETERO_PREFILL_MODEL=$M/fp8 HETERO_PREFILL_BACKEND=cuda HETERO_PREFILL_ARITH=fast \
    HETERO_PREFILL_WEIGHT_DTYPE=checkpoint HETERO_PYTHON=$PY HETERO_REVISION=${REV:-unknown} \
    timeout "${LONG_TIMEOUT:-540}" python3 memory.py --model $M/native --sizes "$LONG_SIZES" \
    --no-native --out-dir "$(realpath "$OUT_DIR")") 2>&1 | tee "$OUT_DIR/long.log"
  rc=${PIPESTATUS[0]}
  echo "rc=$rc"
  exit "$rc"
fi
if [[ -n ${WARM_TURNS:-} ]]; then
  # shellcheck disable=SC2086  # WARM_TURNS is a list of flags
  (cd bench && HETERO_PREFILL_BACKEND=cuda HETERO_PREFILL_ARITH=fast \
    HETERO_PREFILL_WEIGHT_DTYPE=checkpoint HETERO_PYTHON=$PY HETERO_REVISION=${REV:-unknown} \
    timeout "${WARM_TIMEOUT:-540}" python3 warm_turns.py --model $M/native --prefill-model $M/fp8 \
    $WARM_TURNS --out-dir "$(realpath "$OUT_DIR")") 2>&1 | tee "$OUT_DIR/warm.log"
  rc=${PIPESTATUS[0]}
  echo "rc=$rc"
  exit "$rc"
fi
rc=0
runs=()
for s in ${STAGES:-one pipeline}; do
  [[ $s == one ]] && runs+=(0)
  [[ $s == pipeline ]] && runs+=("$pipeline")
done
for gpus in "${runs[@]}"; do
  for p in prompts/chat/*.json; do
    name=$(basename "$p" .json)
    timeout 900 build/hetero verify --model $M/native --prefill-model $M/fp8 --python $PY \
      --backend cuda --arith fast --weight-dtype checkpoint --gpus "$gpus" --prompt-file "$p" \
      --max-tokens 32 --min-cosine "${MIN_COSINE:-0.99}" --max-ulp "${MAX_ULP:-65536}" \
      --reason "deepseek_v4 on the GPU computes in fast arithmetic (tensor cores): its cache is within a tolerance of the decoder's" \
      >"$OUT_DIR/verify.out" 2>"$OUT_DIR/verify-${gpus//,/_}-$name.err"
    code=$?
    python3 - "$OUT_DIR/verify.out" "$OUT_DIR/verify.jsonl" "$gpus" "$name" "$code" "${REV:-unknown}" <<'PY'
import json, sys
src, out, gpus, name, code, rev = sys.argv[1:7]
try:
    r = json.load(open(src))
except Exception as e:
    r = {"error": f"no JSON from verify: {e}"}
r.update({"gpus": gpus, "prompt": name, "rc": int(code), "revision": rev})
with open(out, "a") as f:
    f.write(json.dumps(r) + "\n")
a, c, d = r.get("arrays", {}), r.get("continuation", {}), r.get("decoder_accounting", {})
print(f"gpus {gpus} {name}: rc {code} pass {r.get('pass')} T {r.get('T')} arrays min_cosine "
      f"{a.get('min_cosine')} bit_exact {a.get('bit_exact')}/{a.get('count')} continuation identical "
      f"{c.get('identical')} (diverges at {c.get('diverges_at')}) processed "
      f"{d.get('bridged', {}).get('processed')} failures {r.get('failures', r.get('error'))}")
PY
    ((code == 0)) || rc=1
  done
done
find "$OUT_DIR" -name 'verify-*.err' -empty -delete
rm -f "$OUT_DIR/verify.out"
echo "rc=$rc"
exit $rc
