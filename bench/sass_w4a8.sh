#!/usr/bin/env bash
# The W4A8 grouped GEMM's main loop counted in its SASS, for each tile the kernel is built for
# (bench/sass_mainloop.py): static instruction counts, for work on the kernel on a machine
# without a GPU. Not a speed; the speed is bench/gpu/w4a8_grouped_bench.cc's on the device.
#   make sass                       (installs nvdisasm from PyPI into .venv, then runs this)
#   OUT=bench/results/x.jsonl bash bench/sass_w4a8.sh   also writes one JSON line per tile
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
nvdisasm=${NVDISASM:-$(find .venv -path '*nvidia*' -name nvdisasm -type f 2>/dev/null | head -1)}
[[ -x "$nvcc" ]] || { echo "sass: no nvcc" >&2; exit 2; }
[[ -n "$nvdisasm" && -x "$nvdisasm" ]] || { echo "sass: no nvdisasm (make sass installs it)" >&2; exit 2; }
dir=build/sass
mkdir -p "$dir"
# The build's own flags for this file (CMakeLists.txt: hetero_w4a8), as a cubin for sm_90a.
"$nvcc" -Isrc -O3 -DNDEBUG -arch=sm_90a -cubin -std=c++17 -Xptxas=-v -x cu \
  src/kernels/cuda/w4a8_grouped_gemm.cu -o "$dir/w4a8.cubin" 2> "$dir/ptxas.txt"
"$nvdisasm" -c "$dir/w4a8.cubin" > "$dir/w4a8.sass"
rev=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src || echo -dirty)
for tile in 128x128 64x128 64x64; do
  m=${tile%x*} n=${tile#*x}
  regs=$(grep -A3 "Compiling entry function.*w4a8_grouped_kernelILi${m}ELi${n}E" "$dir/ptxas.txt" |
         grep -o 'Used [0-9]* registers' | grep -o '[0-9]*')
  echo "tile ${tile}: ${regs} registers a thread"
  python3 bench/sass_mainloop.py "$dir/w4a8.sass" --kernel "w4a8_grouped_kernelILi${m}ELi${n}E"
  if [[ -n "${OUT:-}" ]]; then
    python3 bench/sass_mainloop.py "$dir/w4a8.sass" --kernel "w4a8_grouped_kernelILi${m}ELi${n}E" \
      --json | python3 -c "import json,sys; d=json.load(sys.stdin); d.update(bench='w4a8_sass',
rev='$rev', tile='$tile', registers=int('$regs'), nvcc='$("$nvcc" --version | tail -1)'); print(json.dumps(d))" >> "$OUT"
  fi
done
