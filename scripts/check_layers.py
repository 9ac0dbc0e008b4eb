#!/usr/bin/env python3
"""The tree's layers, checked: each folder under src/ includes only the folders it may depend
on (ARCHITECTURE.md: common -> kernels -> model -> engine/bridge -> prefill | decode -> front).
The decode side (decode/, front/) never sees a prefill engine, its kernels or the prefill host:
it meets them only through the bridge's wire contract. Exit 1 naming every offending include."""

import re
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
    for line in bad:
        print(line)
    print("layers: ok" if not bad else f"layers: {len(bad)} violation(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
