#!/usr/bin/env python3
"""The tree's layers, checked: each folder under src/ includes only the folders it may depend
on (ARCHITECTURE.md: common -> kernels -> model -> engine/bridge -> prefill | decode -> front).
The decode side (decode/, front/) never sees a prefill engine, its kernels or the prefill host:
it meets them only through the bridge's wire contract. With --binary PATH (the hetero-front
executable) it also checks that no engine, prefill host or CUDA symbol was linked into it.
Exit 1 naming every offence."""

import re
import subprocess
import sys
from pathlib import Path

ALLOWED = {
    "common": {"common"},
    "kernels": {"common", "kernels"},
    "model": {"common", "kernels", "model"},
    "engine": {"common", "kernels", "model", "engine"},
    "bridge": {"common", "kernels", "model", "engine", "bridge"},
    "prefill": {"common", "kernels", "model", "engine", "bridge", "prefill"},
    "decode": {"common", "bridge", "decode"},
    "front": {"common", "bridge", "decode", "front"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/', re.M)
# What must not be in the front door's binary: the engines, the prefill host, the CUDA runtime.
FORBIDDEN_SYMBOLS = re.compile(r"LlamaCpuEngine|Dsv4CpuEngine|LlamaCudaEngine|Dsv4CudaEngine|"
                               r"PrefillService|cudaMalloc|cublasCreate")


def check_binary(path: str) -> list:
    names = subprocess.run(["nm", "-C", path], capture_output=True, text=True, check=True).stdout
    found = sorted({m.group(0) for m in FORBIDDEN_SYMBOLS.finditer(names)})
    return [f"{path} links {name}" for name in found]


def main() -> int:
    src = Path(__file__).resolve().parents[1] / "src"
    bad = []
    for path in sorted(src.rglob("*")):
        if path.suffix not in {".h", ".cc", ".cu", ".cuh"}:
            continue
        layer = path.relative_to(src).parts[0]
        allowed = ALLOWED.get(layer)
        if allowed is None:
            bad.append(f"{path.relative_to(src)}: folder {layer!r} has no layer rule")
            continue
        for m in INCLUDE.finditer(path.read_text(errors="replace")):
            if m.group(1) not in allowed:
                bad.append(f"{path.relative_to(src)} includes {m.group(1)}/ ({layer}/ may not)")
    if len(sys.argv) == 3 and sys.argv[1] == "--binary":
        bad += check_binary(sys.argv[2])
    for line in bad:
        print(line)
    print("layers: ok" if not bad else f"layers: {len(bad)} violation(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
