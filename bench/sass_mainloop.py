#!/usr/bin/env python3
"""A kernel's main loop, counted in its SASS: instructions per basic block and by kind.

Static counts, not a measurement of speed: they say what a warp issues per trip of the loop when
it takes every block but the excluded ones, which is what an issue-bound kernel runs short of
(docs/findings/w4a8-experts-on-hopper.md). Reads `nvdisasm -c` output of a cubin:

  nvcc ... -arch=sm_90a -cubin -o k.cubin && nvdisasm -c k.cubin > k.sass
  python3 bench/sass_mainloop.py k.sass --kernel 'w4a8_grouped_kernelILi128ELi128E'

The loop is the innermost one whose body holds --marker (default: the tensor cores' GMMA; --loop
picks among several); its body runs from the label a backward branch returns to, to that branch.
`make sass` (bench/sass_counts.sh) prints this for the W4A8 GEMM's tiles and DeepSeek-V4's
attention.
"""
import argparse
import collections
import json
import re
import sys

INSN = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^(\.L_x_\d+):")
FUNC = re.compile(r"^\s*\.text\.(\S+):")
BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA\s+`?\(?(\.L_x_\d+)")

# Kinds by opcode prefix, first match wins.
KINDS = [
    ("tensor", ("HGMMA", "QGMMA", "HMMA", "IMMA", "WARPGROUP")),
    ("copy-async", ("LDGSTS", "LDGDEPBAR", "DEPBAR")),
    ("shared", ("LDS", "STS", "LDSM")),
    ("generic-mem", ("LD.", "ST.", "LD ", "ST ")),
    ("global", ("LDG", "STG", "RED", "ATOM")),
    ("local", ("LDL", "STL")),
    ("sync", ("BAR", "MEMBAR", "FENCE", "BSSY", "BSYNC", "WARPSYNC")),
    ("branch", ("BRA", "EXIT")),
    ("float", ("FFMA", "FMUL", "FADD", "FMNMX", "F2F", "F2I", "I2F", "FSET", "FSEL", "FCHK")),
    ("byte-permute", ("PRMT",)),
]


def kind(op):
    if op.startswith("@!PT "):  # never executes, but is issued (the compiler's hazard padding)
        return "predicated-off"
    body = re.sub(r"^@!?U?P\w+\s+", "", op)
    for name, prefixes in KINDS:
        if any(body.startswith(p) for p in prefixes):
            return name
    return "integer/other"


def functions(lines):
    """name -> list of (kind, line) where kind is 'label' or 'insn'."""
    out, cur = {}, None
    for line in lines:
        m = FUNC.match(line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        m = LABEL.match(line)
        if m:
            cur.append(("label", m.group(1)))
            continue
        m = INSN.match(line)
        if m:
            cur.append(("insn", m.group(2)))
    return out


def innermost_loop(body, index, mark):
    """(head, back branch) of the innermost loop around instruction `mark`, or None."""
    best = None
    for j, (t, v) in enumerate(body):
        m = BRANCH.match(v) if t == "insn" else None
        if not m or m.group(2) not in index:
            continue
        head = index[m.group(2)]
        if head <= mark < j and (best is None or j - head < best[1] - best[0]):
            best = (head, j)
    return best


def main_loop(body, marker, nth=1):
    """The instructions of the nth distinct innermost loop holding a `marker`, as blocks."""
    index = {v: i for i, (t, v) in enumerate(body) if t == "label"}
    loops = []
    for i, (t, v) in enumerate(body):
        if t == "insn" and marker in v:
            loop = innermost_loop(body, index, i)
            if loop and loop not in loops:
                loops.append(loop)
    if len(loops) < nth:
        sys.exit(f"{len(loops)} loops hold {marker!r}, not {nth}")
    best = loops[nth - 1]
    blocks, cur = [], None
    for t, v in body[best[0] : best[1] + 1]:
        if t == "label" or cur is None:
            cur = {"label": v if t == "label" else "(head)", "insns": []}
            blocks.append(cur)
        if t == "insn":
            cur["insns"].append(v)
            if BRANCH.match(v):
                cur = None
    return [b for b in blocks if b["insns"]]


def summarise(blocks, exclude):
    rows, total = [], collections.Counter()
    for b in blocks:
        kinds = collections.Counter(kind(op) for op in b["insns"])
        skipped = bool(exclude and any(exclude.search(op) for op in b["insns"]))
        rows.append({"label": b["label"], "insns": len(b["insns"]), "excluded": skipped,
                     "kinds": dict(kinds)})
        if not skipped:
            total.update(kinds)
    return rows, total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sass", help="nvdisasm -c output")
    ap.add_argument("--kernel", required=True, help="substring of the mangled kernel name")
    ap.add_argument("--marker", default="GMMA", help="an instruction inside the loop")
    ap.add_argument("--loop", type=int, default=1,
                    help="which of the loops holding the marker, in code order (default 1)")
    ap.add_argument("--exclude", default="F2FP|STL|LDL",
                    help="leave out blocks with an instruction matching this regex (default: "
                         "the float conversions of the W4A8 widening's fallback path)")
    ap.add_argument("--blocks", action="store_true", help="print each block")
    ap.add_argument("--json", action="store_true", help="one JSON line")
    a = ap.parse_args()
    funcs = functions(open(a.sass).read().splitlines())
    names = [n for n in funcs if a.kernel in n]
    if len(names) != 1:
        sys.exit(f"{len(names)} kernels match {a.kernel!r}: {names}")
    blocks = main_loop(funcs[names[0]], a.marker, a.loop)
    rows, total = summarise(blocks, re.compile(a.exclude) if a.exclude else None)
    count = sum(total.values())
    if a.json:
        print(json.dumps({"kernel": a.kernel, "loop": a.loop, "loop_insns": count,
                          "kinds": dict(total),
                          "blocks": len(rows),
                          "excluded_blocks": sum(r["excluded"] for r in rows)}))
        return
    if a.blocks:
        for r in rows:
            mark = " (excluded)" if r["excluded"] else ""
            print(f"  {r['label']:>10} {r['insns']:5d}{mark}  {r['kinds']}")
    print(f"{a.kernel}: {count} instructions a warp per loop trip, "
          f"{len(rows)} blocks, {sum(r['excluded'] for r in rows)} excluded")
    for k, v in sorted(total.items(), key=lambda x: -x[1]):
        print(f"  {k:14s} {v}")


if __name__ == "__main__":
    main()
