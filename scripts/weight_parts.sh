#!/usr/bin/env bash
# The default model's real weights to the GPU machine: one call carries at most 64 MiB with the
# tree, the weights are 269 MB. `split` packs them (xz, ~70%) into N folders that travel one per
# call (carry ".weights/K"; what a call carried stays there while the machine is held);
# `join` checks every part against the manifest and writes the checkpoint's weights back,
# bit for bit (sha256 of the original).
#
# usage: scripts/weight_parts.sh split SRC_MODEL_DIR OUT_DIR N   (here)
#        scripts/weight_parts.sh join  PARTS_DIR DEST_MODEL_DIR   (there; bench/gpu/e2e_device.sh)
set -euo pipefail
FILE=model.safetensors

case ${1:-} in
  split)
    (($# == 4)) || { echo "usage: $0 split SRC_MODEL_DIR OUT_DIR N" >&2; exit 2; }
    src=$2/$FILE out=$3 n=$4
    [[ -f $src ]] || { echo "weight_parts: $src missing" >&2; exit 1; }
    rm -rf "$out"
    mkdir -p "$out"
    xz -T0 -6 -c "$src" >"$out/all.xz"
    size=$(stat -c %s "$out/all.xz")
    per=$(((size + n - 1) / n))
    split -b "$per" -d -a 2 "$out/all.xz" "$out/part."
    rm "$out/all.xz"
    sum=$(sha256sum "$src" | cut -d' ' -f1)
    k=0
    for p in "$out"/part.*; do
      k=$((k + 1))
      mkdir -p "$out/$k"
      mv "$p" "$out/$k/"
      # Every folder carries the manifest, so any one of them says what the whole must be.
      printf '%s %s %d %s\n' "$FILE" "$sum" "$n" "$(sha256sum "$out/$k/$(basename "$p")" |
        cut -d' ' -f1)" >"$out/$k/MANIFEST"
    done
    echo "weight_parts: $src ($(stat -c %s "$src") bytes) -> $k parts of <= $per bytes in $out"
    du -sh "$out"/*
    ;;
  join)
    (($# == 3)) || { echo "usage: $0 join PARTS_DIR DEST_MODEL_DIR" >&2; exit 2; }
    dir=$2 dest=$3
    mapfile -t manifests < <(ls "$dir"/*/MANIFEST 2>/dev/null | sort -V)
    ((${#manifests[@]})) || { echo "weight_parts: no parts under $dir" >&2; exit 1; }
    read -r name sum n _ <"${manifests[0]}"
    ((${#manifests[@]} == n)) ||
      { echo "weight_parts: $n parts expected, ${#manifests[@]} under $dir" >&2; exit 1; }
    parts=()
    for m in "${manifests[@]}"; do
      read -r mname msum mn psum <"$m"
      p=$(ls "$(dirname "$m")"/part.* 2>/dev/null | head -1)
      [[ $mname == "$name" && $msum == "$sum" && $mn == "$n" && -f $p ]] ||
        { echo "weight_parts: $m does not belong with ${manifests[0]}" >&2; exit 1; }
      [[ $(sha256sum "$p" | cut -d' ' -f1) == "$psum" ]] ||
        { echo "weight_parts: $p is damaged (sha256)" >&2; exit 1; }
      parts+=("$p")
    done
    mkdir -p "$dest"
    cat "${parts[@]}" | xz -d -T0 >"$dest/$name.tmp"
    [[ $(sha256sum "$dest/$name.tmp" | cut -d' ' -f1) == "$sum" ]] ||
      { rm -f "$dest/$name.tmp"; echo "weight_parts: joined $name differs (sha256)" >&2; exit 1; }
    mv "$dest/$name.tmp" "$dest/$name"
    echo "weight_parts: $n parts -> $dest/$name ($(stat -c %s "$dest/$name") bytes, sha256 ok)"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
    ;;
esac
