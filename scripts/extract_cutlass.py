#!/usr/bin/env python3
"""Extracts CUTLASS's C++ headers from its PyPI wheel (nvidia-cutlass ships the sources under
cutlass_library/source/): include/ to OUT/include and tools/util/include/ to OUT/util/include,
with the license beside them. Usage: extract_cutlass.py WHEEL_DIR OUT."""
import glob
import os
import sys
import zipfile


def main() -> int:
    wheel_dir, out = sys.argv[1], sys.argv[2]
    wheels = glob.glob(os.path.join(wheel_dir, "nvidia_cutlass-*.whl"))
    if len(wheels) != 1:
        print(f"expected one nvidia_cutlass wheel in {wheel_dir}, found {wheels}", file=sys.stderr)
        return 1
    roots = {
        "cutlass_library/source/include/": "include/",
        "cutlass_library/source/tools/util/include/": "util/include/",
    }
    count = 0
    with zipfile.ZipFile(wheels[0]) as z:
        for name in z.namelist():
            if name.endswith("/"):
                continue
            if "/licenses/" in name and name.endswith("LICENSE.txt"):
                dest = "LICENSE.txt"
            else:
                dest = next((d + name[len(r):] for r, d in roots.items() if name.startswith(r)), None)
            if dest is None:
                continue
            path = os.path.join(out, dest)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with z.open(name) as src, open(path, "wb") as dst:
                dst.write(src.read())
            count += 1
    if not os.path.exists(os.path.join(out, "include/cutlass/cutlass.h")):
        print("the wheel held no include/cutlass/cutlass.h", file=sys.stderr)
        return 1
    print(f"CUTLASS headers: {count} files in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
