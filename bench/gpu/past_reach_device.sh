#!/usr/bin/env bash
# The GPU machine's half of bench/past_reach_cuda.py: `hetero prefill --backend cuda` in both
# arithmetics on each variant's ids, with the decoder's calls prep wrote beside them. Runs from
# the repository root with .devkit/lib and build/hetero carried; writes the 8 caches into $OUT (or
# out/; the device tool brings back 8 files), the prefill host's log into /tmp.
# usage: bench/gpu/past_reach_device.sh DIR
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
DIR=${1:?usage: bench/gpu/past_reach_device.sh DIR}
OUT_DIR=${OUT:-out}
mkdir -p "$OUT_DIR"
source bench/gpu/devkit_libs.sh
devkit_libs /tmp/hetero-lib build/hetero > /dev/null || exit 1
rc=0
for vd in "$DIR"/*/; do
  name=$(basename "$vd")
  for ids in "$vd"ids-*.json; do
    T=${ids##*ids-}
    T=${T%.json}
    for arith in exact fast; do
      timeout 120 build/hetero prefill --backend cuda --arith "$arith" --model "$vd/hf" \
        --weights "$vd/export" --ids-file "$ids" --decoder-calls "$(cat "$vd/calls-$T.txt")" \
        --decoder-path single --out "$OUT_DIR/$name-$arith-$T.safetensors" \
        >> /tmp/past-reach-device.log 2>&1
      code=$?
      echo "$name T=$T arith=$arith rc=$code"
      ((code == 0)) || rc=1
    done
  done
done
exit $rc
