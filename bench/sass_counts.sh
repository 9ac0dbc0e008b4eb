#!/usr/bin/env bash
# The main loops of the kernels that bound DeepSeek-V4's prefill, counted in their SASS
# (bench/sass_mainloop.py): the W4A8 grouped GEMM's (each tile it is built for), the sparse
# attention's two passes at Flash's head dim, and the indexer's row scoring. Static instruction
# counts, for work on the kernels on a machine without a GPU; not a speed (the speeds are
# bench/gpu/'s, on the device).
#   make sass                         (installs nvdisasm from PyPI into .venv, then runs this)
#   OUT=bench/results/x.jsonl bash bench/sass_counts.sh   also writes one JSON line per loop
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
nvdisasm=${NVDISASM:-$(find .venv -path '*nvidia*' -name nvdisasm -type f 2>/dev/null | head -1)}
[[ -x "$nvcc" ]] || { echo "sass: no nvcc" >&2; exit 2; }
[[ -n "$nvdisasm" && -x "$nvdisasm" ]] || { echo "sass: no nvdisasm (make sass installs it)" >&2; exit 2; }
dir=build/sass
mkdir -p "$dir"
rev=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src || echo -dirty)
nvcc_version=$("$nvcc" --version | tail -1)
# name, source, architecture (as CMakeLists.txt builds it)
cubin() {
  "$nvcc" -Isrc -O3 -DNDEBUG -arch="$3" -cubin -std=c++17 -Xptxas=-v -x cu "$2" \
    -o "$dir/$1.cubin" 2> "$dir/$1.ptxas.txt"
  "$nvdisasm" -c "$dir/$1.cubin" > "$dir/$1.sass"
}
# name, kernel (mangled-name substring), marker, loop, label, blocks to leave out (regex; the
# W4A8 widening's float fallback, which trained weights do not take)
count() {
  local regs
  regs=$(grep -A3 "Compiling entry function.*$2" "$dir/$1.ptxas.txt" |
         grep -o 'Used [0-9]* registers' | grep -o '[0-9]*' | head -1)
  echo "$5: ${regs} registers a thread"
  python3 bench/sass_mainloop.py "$dir/$1.sass" --kernel "$2" --marker "$3" --loop "$4" \
    --exclude "$6"
  if [[ -n "${OUT:-}" ]]; then
    python3 bench/sass_mainloop.py "$dir/$1.sass" --kernel "$2" --marker "$3" --loop "$4" \
      --exclude "$6" --json |
      WHAT="$5" REGS="$regs" REV="$rev" NVCC_VERSION="$nvcc_version" python3 -c "import json, os, sys
d = json.load(sys.stdin)
d.update(bench='sass_mainloop', rev=os.environ['REV'], what=os.environ['WHAT'],
         registers=int(os.environ['REGS']), nvcc=os.environ['NVCC_VERSION'])
print(json.dumps(d))" >> "$OUT"
  fi
}
cubin w4a8 src/kernels/cuda/w4a8_grouped_gemm.cu sm_90a
# Warp-specialized: the consumers' loop (wgmma, promotion) and the producers' (copies, widening),
# each counted a warp per k tile. The producers' count takes the fast widening path only (its
# float fallback's blocks are left out) and leaves out the blocks that set a new tile's copies up
# (their global loads: once a tile). The first loop holding a PRMT is the consumers' loop over
# tiles (the epilogue's), the second the producers' loop.
for tile in 128x128 64x256 64x128 64x64; do
  count w4a8 "w4a8_grouped_kernelILi${tile%x*}ELi${tile#*x}E" GMMA 1 \
    "W4A8 GEMM, tile $tile, consumer" 'F2FP|STL|LDL'
  count w4a8 "w4a8_grouped_kernelILi${tile%x*}ELi${tile#*x}E" PRMT 2 \
    "W4A8 GEMM, tile $tile, producer" 'F2FP|STL|LDL|LDG(?!STS)'
done
cubin attention src/kernels/cuda/dsv4_fwd_attention.cu sm_90
count attention wide_attention_kernelILi512E HMMA 1 "sparse attention D 512, pass 1 (scores)" ''
count attention wide_attention_kernelILi512E HMMA 2 "sparse attention D 512, pass 2 (P.V)" ''
count attention index_select_kernel HMMA 1 "indexer, scoring a tile of 64 rows (all rows)" ''
count attention index_select_kernel HMMA 2 "indexer, scoring a tile of 64 rows (HISA's kept blocks)" ''
