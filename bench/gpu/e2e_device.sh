#!/usr/bin/env bash
# The served stack end to end on the GPU machine: prefill host (`hetero`, built elsewhere and
# carried, backend by flag), the MLX decoder on the machine's CPU cores (carried wheels), the
# front door. Runs, from the repo root, with .devkit/ (scripts/devkit.sh) and build/hetero carried:
#   1. installs the carried wheels into a private site dir (the machine's python3 keeps its own
#      packages; only mlx, mlx-cpu and mlx-lm are added), unpacks the carried libraries the
#      machine lacks, and checks that mlx computes on the CPU;
#   2. writes a seeded random checkpoint with the default model's config and tokenizer
#      (scripts/make_random_llama.py), or, with --real-weights, reassembles the default model's
#      real weights from parts carried in earlier calls (scripts/weight_parts.sh);
#   3. `hetero verify` on a few prompts: every cache array, the greedy continuation and the
#      decoder's own prompt accounting against the decoder's native run;
#   4. bench/cold.py: native vs bridged time to first token over prompt sizes, every verdict,
#      decode tok/s of both legs;
#   5. with --memory-sizes: bench/memory.py, bridged only: each process's peak RSS against the
#      cache, the decoder-confirmed verdict and time to first token, at long prompt sizes.
# Everything has a deadline; only processes this script started are stopped.
# Writes into --out (default $OUT, else out/e2e): e2e.log, env.txt, verify.jsonl,
# cold-<rev>.{jsonl,md,png}.
#
# usage: bench/gpu/e2e_device.sh [--backend cpu|cuda] [--sizes 1024,4096,16384] [--scale 135m]
#          [--repeat 1] [--max-tokens 32] [--verify N] [--verify-tokens 32]
#          [--verify-timeout 600] [--bench-timeout 1800] [--out DIR] [--no-bench]
#          [--rev REV (the carried build/hetero's revision; recorded with every result)]
#          [--verify-args "extra verify flags, e.g. --arith fast --min-cosine 0.99 ..."]
#          [--model-args "extra scripts/make_random_llama.py flags, e.g. a rope scaling (read by
#           the shell: quote a JSON value inside, --rope-scaling '{...}')"]
#          [--memory-sizes 262144,1000000 (step 5; with --no-bench it runs alone)]
#          [--warm-turns "bench/warm_turns.py flags (step 6: a conversation bridged by its tails
#           against the decoder's own; e.g. --turns 8 --min-words 300 --max-words 900)"]
#          [--concurrent "bench/bridges_at_once.py flags (step 7: N cold bridges at once against
#           the same N one after another, and the decoder's own answers; e.g. --n 8 --words 3000)"]
#          [--short-behind-long "bench/short_behind_long.py flags (step 8: a short prompt sent
#           while a long one prefills, with and without the prefill host's turns)"]
#          [--real-weights DIR (the parts scripts/weight_parts.sh wrote, under DIR/*/)]
#          [--prompts all|FILE,FILE (every prompt below, the long one too, or these prompt
#           files; default: the first --verify)]
#          [--quantize BITS[,GROUP[,MODE]] (the checkpoint then converted by mlx-lm's own
#           converter: affine, group 64 unless given; MODE mxfp4 or mxfp8, group 32; decoder and
#           prefill host both run the quantized one)]
# device tool: run(command="bench/gpu/e2e_device.sh --sizes 512,1024",
#                   carry=[".devkit", "build/hetero"], kind="nvidia-h200")
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD

ARGS="$*"
REVISION=""
BACKEND=${HETERO_PREFILL_BACKEND:-cpu}
SIZES=1024,4096,16384
SCALE=135m
REPEAT=1
MAX_TOKENS=32
VERIFY_N=3
VERIFY_TOKENS=32
VERIFY_TIMEOUT=600
BENCH_TIMEOUT=1800
OUT_DIR=${OUT:-$ROOT/out/e2e}
RUN_BENCH=1
VERIFY_EXTRA=()
MODEL_EXTRA=()
QUANTIZE=""
PROMPTS=(prompts/capital.txt prompts/chat/02-code.json prompts/chat/03-system-multiturn.json
         prompts/chat/01-capital.json prompts/chat/04-notes.json prompts/chat/05-long-license.json)
REAL_WEIGHTS=""
MEMORY_SIZES=""
RUN_WARM=0
WARM_TURNS=()
RUN_CONCURRENT=0
CONCURRENT=()
RUN_SBL=0
SBL=()

while (($#)); do
  case $1 in
    --backend) BACKEND=$2; shift ;;
    --sizes) SIZES=$2; shift ;;
    --scale) SCALE=$2; shift ;;
    --repeat) REPEAT=$2; shift ;;
    --max-tokens) MAX_TOKENS=$2; shift ;;
    --verify) VERIFY_N=$2; shift ;;
    --verify-tokens) VERIFY_TOKENS=$2; shift ;;
    --verify-timeout) VERIFY_TIMEOUT=$2; shift ;;
    --bench-timeout) BENCH_TIMEOUT=$2; shift ;;
    --out) OUT_DIR=$2; shift ;;
    --rev) REVISION=$2; shift ;;
    --no-bench) RUN_BENCH=0 ;;
    --verify-args) read -r -a VERIFY_EXTRA <<<"$2"; shift ;;
    --model-args) eval "MODEL_EXTRA=($2)"; shift ;;
    --quantize) QUANTIZE=$2; shift ;;
    --real-weights) REAL_WEIGHTS=$2; shift ;;
    --memory-sizes) MEMORY_SIZES=$2; shift ;;
    --warm-turns) read -r -a WARM_TURNS <<<"$2"; RUN_WARM=1; shift ;;
    --concurrent) read -r -a CONCURRENT <<<"$2"; RUN_CONCURRENT=1; shift ;;
    --short-behind-long) read -r -a SBL <<<"$2"; RUN_SBL=1; shift ;;
    --prompts) [[ $2 == all ]] || IFS=, read -r -a PROMPTS <<<"$2"
               VERIFY_N=${#PROMPTS[@]}; shift ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "e2e: unknown option $1 (--help)" >&2; exit 2 ;;
  esac
  shift
done

WORK=${TMPDIR:-/tmp}/hetero-e2e
SITE=$WORK/site
LIB=$WORK/lib
PY=$WORK/python
MODEL=$WORK/models/random-$SCALE
mkdir -p "$OUT_DIR" "$WORK" "$LIB"
exec > >(tee -a "$OUT_DIR/e2e.log") 2>&1

CURRENT=""  # pid of the step in flight: the only process a signal here stops
on_signal() {
  [[ -n $CURRENT ]] && kill -TERM "$CURRENT" 2>/dev/null
  echo "e2e: interrupted"
  exit 130
}
trap on_signal INT TERM

# step SECONDS CMD...: CMD under a deadline (TERM, then KILL 20 s later); returns its status.
step() {
  local limit=$1
  shift
  timeout -k 20 "$limit" "$@" &
  CURRENT=$!
  wait "$CURRENT"
  local rc=$?
  CURRENT=""
  ((rc == 124)) && echo "e2e: deadline of ${limit}s passed: $*" >&2
  return "$rc"
}

die() {
  echo "e2e: FAILED: $*"
  exit 1
}

# --- 1. environment ----------------------------------------------------------------------------
# The carried binary's revision (--rev): the GPU machine's copy of .git and the kit's REVISION
# (the tree the kit was built from) can both be older than it.
[[ -n ${REVISION:-} ]] || REVISION="kit-$(cat .devkit/REVISION 2>/dev/null || echo unknown)"
GPU=$(timeout 20 nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null |
      head -1)
{
  echo "date: $(date -u +%FT%TZ)"
  echo "revision: $REVISION"
  echo "host: $(uname -n), $(nproc) cpus," \
    "$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "gpu: ${GPU:-none}"
  echo "python3: $(python3 -V 2>&1) at $(command -v python3)"
  echo "backend: $BACKEND, scale: $SCALE, sizes: $SIZES, repeat: $REPEAT, max tokens: $MAX_TOKENS"
  echo "command: $0 $ARGS"
} | tee "$OUT_DIR/env.txt"
[[ -d .devkit/whl && -d .devkit/lib && -d .devkit/model ]] ||
  die ".devkit missing: run scripts/devkit.sh here and carry .devkit"
[[ -x build/hetero ]] || die "build/hetero missing: build it and carry build/hetero"

echo "== wheels -> $SITE"
step 300 python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target "$SITE" .devkit/whl/*.whl || die "wheel install"

# The decoder's interpreter: the machine's python3 plus the carried wheels. hetero sets its
# children's PYTHONPATH to python/ (the seam), so the site dir is appended here, not replaced.
cat >"$PY" <<EOF
#!/bin/sh
export PYTHONPATH="\${PYTHONPATH:+\$PYTHONPATH:}$SITE"
exec $(command -v python3) "\$@"
EOF
chmod +x "$PY"
step 120 "$PY" -c '
import time, mlx.core as mx, mlx_lm, transformers, numpy
a = mx.random.normal((1024, 1024)); mx.eval(a)
t = time.perf_counter(); b = a @ a; mx.eval(b); ms = (time.perf_counter() - t) * 1e3
print(f"mlx {mx.__version__} on {mx.default_device()}, mlx-lm {mlx_lm.__version__}, "
      f"transformers {transformers.__version__}, numpy {numpy.__version__}; "
      f"1024^3 matmul {ms:.1f} ms, sum {float(b.sum()):.3f}")' || die "mlx does not run here"

# Only libraries the machine lacks are unpacked (bench/gpu/devkit_libs.sh).
echo "== libraries the machine lacks -> $LIB"
bins=(build/hetero)
[[ -x build/hetero_gpu_tests ]] && bins+=(build/hetero_gpu_tests)
source bench/gpu/devkit_libs.sh
devkit_libs "$LIB" "${bins[@]}" || die "build/hetero still lacks libraries"
step 30 ./build/hetero --help 2>/dev/null || die "build/hetero does not start"

HAS_BACKEND_FLAG=0
# Read whole, not through `grep -q`: under pipefail, grep leaving early fails the writer (SIGPIPE).
VERIFY_HELP=$(./build/hetero verify --help 2>&1)
[[ $VERIFY_HELP == *--backend* ]] && HAS_BACKEND_FLAG=1
if ((!HAS_BACKEND_FLAG)) && [[ $BACKEND != cpu ]]; then
  die "this build/hetero has no --backend; only --backend cpu runs with it"
fi
export HETERO_PREFILL_BACKEND=$BACKEND  # read by hetero up / prefill once they know it
export PYTHONUNBUFFERED=1

# --- 2. checkpoint -----------------------------------------------------------------------------
if [[ -n $REAL_WEIGHTS ]]; then
  # The real weights (269 MB) exceed one call's carry: earlier calls carried them in parts.
  [[ $SCALE == 135m && ${#MODEL_EXTRA[@]} -eq 0 ]] ||
    die "--real-weights is the default model's own: no --scale or --model-args with it"
  SCALE=real-135m
  MODEL=$WORK/models/$SCALE
  echo "== the default model's real weights from $REAL_WEIGHTS -> $MODEL"
  step 600 bash scripts/weight_parts.sh join "$REAL_WEIGHTS" "$MODEL" || die "real weights"
  cp .devkit/model/* "$MODEL/" || die "config and tokenizer"
else
  echo "== random checkpoint ($SCALE) -> $MODEL"
  step 1200 python3 scripts/make_random_llama.py --tokenizer .devkit/model --out "$MODEL" \
    --scale "$SCALE" "${MODEL_EXTRA[@]}" || die "checkpoint"
fi
if [[ -n $QUANTIZE ]]; then
  IFS=, read -r QBITS QGROUP QMODE <<< "$QUANTIZE"
  QGROUP=${QGROUP:-64} QMODE=${QMODE:-affine}
  QDIR=$MODEL-q$QBITS-g$QGROUP-$QMODE
  echo "== mlx-lm's converter: $QMODE, $QBITS bits, group $QGROUP -> $QDIR"
  rm -rf "$QDIR"
  step 600 "$PY" -m mlx_lm convert --hf-path "$MODEL" --mlx-path "$QDIR" -q \
    --q-bits "$QBITS" --q-group-size "$QGROUP" --q-mode "$QMODE" || die "quantize"
  MODEL=$QDIR
  MODEL_EXTRA+=(--quantize "$QBITS,$QGROUP,$QMODE")  # recorded with every result
fi

# --- 3. verify ---------------------------------------------------------------------------------
fails=0
weights=()
for ((i = 0; i < VERIFY_N && i < ${#PROMPTS[@]}; i++)); do
  prompt=${PROMPTS[$i]}
  wd=$WORK/verify-$SCALE-$i
  rm -rf "$wd"
  args=(verify --model "$MODEL" --python "$PY" --prompt-file "$prompt"
        --max-tokens "$VERIFY_TOKENS" --work-dir "$wd" "${weights[@]}")
  ((HAS_BACKEND_FLAG)) && args+=(--backend "$BACKEND")
  args+=("${VERIFY_EXTRA[@]}")
  echo "== hetero ${args[*]}"
  step "$VERIFY_TIMEOUT" ./build/hetero "${args[@]}" >"$wd.json"
  rc=$?
  python3 - "$wd.json" "$rc" "$prompt" "$BACKEND" "$SCALE" "$REVISION" \
    "$OUT_DIR/verify.jsonl" "${MODEL_EXTRA[*]}" <<'EOF'
import json, sys
path, rc, prompt, backend, scale, rev, out, model_args = sys.argv[1:]
try:
    r = json.load(open(path))
except ValueError:
    r = {"pass": False, "failures": ["no report (see the log above)"]}
r.get("arrays", {}).pop("per_layer", None)
r.update(prompt=prompt, rc=int(rc), prefill_backend=backend, scale=scale, revision=rev,
         model_args=model_args)
with open(out, "a") as f:
    f.write(json.dumps(r) + "\n")
a, c = r.get("arrays", {}), r.get("continuation", {})
same = "identical" if c.get("identical") else f"differs at {c.get('diverges_at')}"
acc = r.get("decoder_accounting", {}).get("bridged", {})
t = r.get("timings_ms", {})
print(f"verify {prompt}: pass={r.get('pass')} rc={rc} T={r.get('T')} "
      f"arrays bit-exact {a.get('bit_exact')}/{a.get('count')} "
      f"elements equal {a.get('equal_fraction', float('nan')):.4f} max ulp {a.get('max_ulp')} "
      f"min cosine {a.get('min_cosine', float('nan')):.5f} "
      f"continuation {same} ({c.get('tokens')} tokens) decoder processed {acc.get('processed')} "
      f"native request {t.get('native_request', 0) / 1e3:.2f} s "
      f"bridge prefill {t.get('bridge_prefill', 0) / 1e3:.2f} s failures={r.get('failures')}")
EOF
  if ((rc != 0)); then
    fails=$((fails + 1))
    for log in "$wd"/decoder.log "$wd"/export.log; do
      [[ -f $log ]] && { echo "--- tail $log"; tail -20 "$log"; }
    done
  elif [[ -d $wd/decoder-weights && ${#weights[@]} -eq 0 ]]; then
    weights=(--weights "$wd/decoder-weights")  # one export serves every prompt
  fi
done
echo "verify: $((VERIFY_N < ${#PROMPTS[@]} ? VERIFY_N : ${#PROMPTS[@]})) prompts, $fails failed"

# --- 4. cold bench -----------------------------------------------------------------------------
brc=0
if ((RUN_BENCH)); then
  echo "== hetero bench cold --sizes $SIZES ($BACKEND backend)"
  HETERO_PYTHON=$PY HETERO_REVISION=$REVISION step "$BENCH_TIMEOUT" ./build/hetero bench cold \
    --model "$MODEL" --sizes "$SIZES" --repeat "$REPEAT" --max-tokens "$MAX_TOKENS" \
    --out-dir "$OUT_DIR"
  brc=$?
  if ((brc != 0)); then
    for log in "${TMPDIR:-/tmp}"/hetero-bench-*/{decoder,prefill,export}.log; do
      [[ -f $log ]] && { echo "--- tail $log"; tail -20 "$log"; }
    done
  fi
fi
# --- 5. long prompts, bridged: memory and verdicts -----------------------------------------------
mrc=0
if [[ -n $MEMORY_SIZES ]]; then
  echo "== bench/memory.py --sizes $MEMORY_SIZES --no-native ($BACKEND backend)"
  (cd bench && HETERO_PYTHON=$PY HETERO_REVISION=$REVISION step "$BENCH_TIMEOUT" python3 memory.py \
    --model "$MODEL" --sizes "$MEMORY_SIZES" --no-native --out-dir "$OUT_DIR")
  mrc=$?
  if ((mrc != 0)); then
    for log in "${TMPDIR:-/tmp}"/hetero-bench-*/{decoder,prefill,export}.log; do
      [[ -f $log ]] && { echo "--- tail $log"; tail -20 "$log"; }
    done
  fi
fi
# A bench script of bench/ against the model, its output under OUT_DIR: bench_script SCRIPT ARGS...
bench_script() {
  local script=$1
  shift
  echo "== bench/$script $* ($BACKEND backend)"
  (cd bench && HETERO_PYTHON=$PY HETERO_REVISION=$REVISION step "$BENCH_TIMEOUT" python3 \
    "$script" --model "$MODEL" "$@" --out-dir "$OUT_DIR")
}
# --- 6. a conversation, bridged by its tails -----------------------------------------------------
wrc=0
if ((RUN_WARM)); then
  bench_script warm_turns.py "${WARM_TURNS[@]}"
  wrc=$?
fi
# --- 7. cold bridges at once ------------------------------------------------------------------
crc=0
if ((RUN_CONCURRENT)); then
  bench_script bridges_at_once.py "${CONCURRENT[@]}"
  crc=$?
fi
# --- 8. a short prompt behind a long one ---------------------------------------------------------
src=0
if ((RUN_SBL)); then
  bench_script short_behind_long.py "${SBL[@]}"
  src=$?
fi
echo "e2e: verify failures $fails, bench rc $brc, memory rc $mrc, warm turns rc $wrc," \
  "concurrent rc $crc, short behind long rc $src; results in $OUT_DIR"
((fails == 0 && brc == 0 && mrc == 0 && wrc == 0 && crc == 0 && src == 0))
