# Sourced by the GPU machine's scripts: devkit_libs LIBDIR BINARY... makes the binaries' shared
# libraries loadable there. Only libraries the machine lacks are unpacked from the carried
# .devkit/lib (scripts/devkit.sh), so LD_LIBRARY_PATH shadows none of the machine's own and the
# decoder and everything else inherit it unharmed; the CUDA toolkit's libraries are the
# machine's, never carried. Returns 1 when build/hetero still lacks one (another binary that
# does is reported, and its caller decides).
devkit_libs() {
  local lib=$1
  shift
  local bins=("$@") missing added name d b
  mkdir -p "$lib"
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  for _ in 1 2 3 4 5; do  # unpacking one library can reveal what it needs in turn
    missing=$(for b in "${bins[@]}"; do ldd "$b"; done | awk '/not found/ {print $1}' | sort -u)
    [[ -z $missing ]] && break
    added=0
    for name in $missing; do
      if [[ -f .devkit/lib/$name ]]; then
        cp .devkit/lib/"$name" "$lib/$name" && added=1
      elif [[ -f .devkit/lib/$name.xz ]]; then
        python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' \
          ".devkit/lib/$name.xz" "$lib/$name" && added=1
      elif [[ $name == libcu* || $name == libnv* || $name == libnccl* ]]; then
        for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
                 $(python3 -c 'import glob, site
print(" ".join(sorted(glob.glob(site.getsitepackages()[0] + "/nvidia/*/lib"))))' 2>/dev/null); do
          if [[ -e $d/$name && :$LD_LIBRARY_PATH: != *:$d:* ]]; then
            export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
            added=1
            break
          fi
        done
      fi
    done
    ((added)) || break
  done
  echo "unpacked: $(find "$lib" -mindepth 1 -printf "%f ")"
  for b in "${bins[@]}"; do
    if ldd "$b" | grep 'not found'; then
      [[ $b == build/hetero ]] && return 1
      echo "devkit_libs: $b lacks the libraries above"
    fi
  done
  return 0
}
