#!/usr/bin/env bash
# Builds .devkit/: what the GPU machine lacks to run the served stack, small enough to travel
# with the working tree (a call to the GPU machine carries at most 64 MiB, the tree included).
#
#   whl/    Python 3.12 manylinux x86_64 wheels of the decoder (pins from requirements.txt).
#           Their other needs (numpy, transformers>=5.7, sentencepiece, protobuf, pyyaml,
#           jinja2) are preinstalled there (device KINDS.md) and are not carried.
#   lib/    the non-system shared libraries build/hetero and build/hetero_gpu_tests link
#           (ldd), those over 1 MiB xz-compressed (OpenBLAS is 35 MiB raw, 4 MiB packed);
#           bench/gpu/e2e_device.sh unpacks only those the machine lacks.
#   model/  the default model's config and tokenizer; the weights (269 MB) cannot travel, so
#           scripts/make_random_llama.py writes a seeded random checkpoint there instead.
#   REVISION  the tree's git revision when the kit was made (-dirty: with uncommitted changes).
#
# usage: scripts/devkit.sh      (after building build/hetero; rerun after every rebuild)
# then:  device run, carry [".devkit", "build/hetero"]: bench/gpu/e2e_device.sh --help
set -euo pipefail
cd "$(dirname "$0")/.."

KIT=.devkit
MODEL=models/smollm2-135m-instruct
LIMIT_MIB=40
WHEELS=(mlx mlx-cpu mlx-lm)
BINARIES=(build/hetero build/hetero_gpu_tests)
MODEL_FILES=(tokenizer.json tokenizer_config.json special_tokens_map.json generation_config.json
             config.json)
# Every Linux has these, and a carried copy would shadow a newer one there (libstdc++ from an
# older compiler breaks what the machine's own Python loads). The CUDA libraries are the
# machine's own: its toolkit matches its driver, and cuBLAS alone is larger than the carry limit;
# NCCL and cuDNN come with its PyTorch (devkit_libs finds them there).
SYSTEM_RE='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libutil|libresolv|libstdc\+\+|'
SYSTEM_RE+='libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libnvrtc|libnvJitLink|libcufft|'
SYSTEM_RE+='libcurand|libcusparse|libcusolver|libcudnn[a-z_]*|libnccl|libnvidia-[a-z-]+)\.so'

if [[ ! -x build/hetero ]]; then
  echo "devkit: build/hetero missing; build first (make build)" >&2
  exit 1
fi
rm -rf "$KIT.new"
mkdir -p "$KIT.new/whl" "$KIT.new/lib" "$KIT.new/model"

# (a) wheels, at the versions requirements.txt pins.
source scripts/pinned_wheels.sh
pinned_wheels "$KIT.new/whl" "${WHEELS[@]}" || exit 1
echo "what they need besides each other (skip extras):"
for f in "$KIT.new"/whl/*.whl; do
  unzip -p "$f" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' |
    grep -v -E 'Requires-Dist: mlx' | sed "s|^|  $(basename "$f"): |" || true
done

# (b) shared libraries, resolved here by ldd, copied through their links.
declare -A seen=()
for bin in "${BINARIES[@]}"; do
  [[ -x $bin ]] || { echo "lib: $bin not built, skipped"; continue; }
  while read -r name path; do
    [[ $name =~ $SYSTEM_RE ]] && continue
    [[ -n ${seen[$name]:-} ]] && continue
    seen[$name]=1
    if [[ ! -e $path ]]; then
      echo "devkit: $bin needs $name, which is not found here" >&2
      exit 1
    fi
    if (($(stat -L -c %s "$path") > 1048576)); then
      xz -T0 -6 -c "$path" >"$KIT.new/lib/$name.xz"
    else
      cp -L "$path" "$KIT.new/lib/$name"
    fi
  done < <(ldd "$bin" | awk '/=>/ {print $1, $3}')
done
echo "libs: $(find "$KIT.new/lib" -mindepth 1 -printf "%f ")"

# (c) the default model's config and tokenizer.
for f in "${MODEL_FILES[@]}"; do
  cp "$MODEL/$f" "$KIT.new/model/$f"
done

rev=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
# Result files are named after it: keep it to [A-Za-z0-9._-].
git diff --quiet HEAD -- 2>/dev/null || rev="$rev-dirty"
echo "$rev" >"$KIT.new/REVISION"

size=$(du -sb "$KIT.new" | cut -f1)
printf 'devkit: %s, %s MiB (whl %s, lib %s, model %s), revision %s\n' "$KIT" \
  "$(awk -v b="$size" 'BEGIN {printf "%.1f", b / 1048576}')" "$(du -sh "$KIT.new/whl" | cut -f1)" \
  "$(du -sh "$KIT.new/lib" | cut -f1)" "$(du -sh "$KIT.new/model" | cut -f1)" "$rev"
if ((size > LIMIT_MIB * 1048576)); then  # the kit in place stays as it was
  echo "devkit: over ${LIMIT_MIB} MiB; it must travel with the tree within 64 MiB ($KIT.new kept)" >&2
  exit 1
fi
rm -rf "$KIT"
mv "$KIT.new" "$KIT"
