#!/usr/bin/env python3
"""docs/RESULTS.md's tables, README.md's short table and docs/plots/ from bench/results/.

    scripts/results.py            regenerate the generated parts (and the plots)
    scripts/results.py --check    regenerate in memory; exit 1 with a diff if the committed files
                                  differ (ctest `results_tables`; no GPU, no matplotlib, ~2 s)

How a row is defined. ROWS below is the table of every figure the project quotes as current:
each Row names its area, the figure and its definition, the raw files it is computed from
(globs under bench/results/), a small function that computes it from their lines (a median of
runs, a ratio of two legs of one run), the code it depends on (git pathspecs) and, where an old
raw line lacks them, constants for its command, GPU or revision, each with the log section it
comes from. Everything else (value, GPU, revision, n, spread) is read from the raw lines. A field
a raw line lacks is filled from the log where the log recorded it and listed as a gap, never
guessed: the "Gaps in the raw lines" section of RESULTS.md lists them all.

Choices, and why:
- Two-run medians. The C++ benches took the upper of two runs as the "median" (bench_common.h's
  spread() before issue 53). With n = 2 a line's min and max are the two runs, so the figure here
  is their mean, and the row says so. Odd n is read as written.
- Extrapolated figures (the DeepSeek-V4 layer bench's implied 43-layer tok/s from 8 layers, the
  implied 43-layer bridge cost from 10) are labelled "extrapolated from N layers", never as a
  measurement of the whole model.
- "Changed since": `git rev-list --count <rev>..<as-of> -- <paths>`, the commits since the row's
  revision that touched any file the figure depends on (a superset: whole kernel files, the
  bench). <as-of> is HEAD when the tables are written, recorded in RESULTS.md, and --check counts
  to that same recorded revision: a later commit to src/ does not fail the check (it would fail
  every commit), but --check says on stderr which rows' code moved since, so the tables get
  rewritten when someone next records a result. A revision that is not in this repository's
  history is said to be so.
- The check compares text: RESULTS.md's and README.md's generated blocks and each plot's data
  (docs/plots/*.csv). The PNGs are not compared: matplotlib's rasterizing depends on its version
  and FreeType, and the check must run where matplotlib is absent; they are drawn from the same
  data as the CSVs, with fixed metadata (no software or date stamp), and rewritten only by a
  plain run.
- Raw files are read from the working tree (bench/results/), so a new raw file must come with a
  rewritten RESULTS.md, as a new number should. A soak or fuzz file still being written (no
  summary line yet) gives a row that says so.
- Python 3.11 stdlib (+ matplotlib for the plots only): the check runs in CI before the venv.
- Three files: this one (rendering, plots, --check), results_rows.py (ROWS and the small
  functions that compute them, which read best next to each other) and results_lib.py (reading
  raw lines and history, formats, the Row and Out records).
"""

from __future__ import annotations

import argparse
import csv
import difflib
import glob
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_lib import *  # noqa: E402,F401,F403
from results_lib import Out, Row  # noqa: E402,F401
from results_rows import ROWS, dynamic_rows  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Rendering


def all_rows() -> list[Row]:
    base = [r for r in ROWS if r.area != "hardening"]
    return base + dynamic_rows()


def cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def compute_all(asof: str) -> list[tuple[Row, Out, str]]:
    out = []
    for r in all_rows():
        o = r.compute(r)
        base = min((v for v in o.revs if re.fullmatch(r"[0-9a-f]{7,40}", v or "")),
                   key=lambda v: commit_time(v) or 1 << 62, default="")
        out.append((r, o, changed_since(base, r.paths, asof) if base else "—"))
    return out


def render_results(computed, asof: str) -> str:
    w = io.StringIO()
    p = lambda *a: print(*a, file=w)  # noqa: E731
    p(BEGIN)
    p(f"*As of {asof}: every figure below is computed from `bench/results/` by `scripts/results.py`; "
      f"\"changed since\" counts the commits from the figure's revision to {asof} that touched the code it "
      f"depends on.*")
    p()
    p("| area | rows |")
    p("|---|---|")
    for key, title in AREAS:
        ids = [r.id for r, _, _ in computed if r.area == key]
        p(f"| [{title.split(':')[0]}](#{key}) | {', '.join(f'`{i}`' for i in ids)} |")
    for key, title in AREAS:
        p()
        p(f'<a id="{key}"></a>')
        p()
        p(f"### {title}")
        p()
        p("| row | figure (definition) | value | GPU / machine | revision | n, spread | changed since | command; raw |")
        p("|---|---|---|---|---|---|---|---|")
        for r, o, ch in computed:
            if r.area != key:
                continue
            status = "" if r.status == "current" else f" *({r.status})*"
            p(f"| <a id=\"{r.id}\"></a>`{r.id}` | **{cell(r.figure)}**{cell(status)}: {cell(r.definition)} | "
              f"{cell(o.value)} | {cell(o.machine)} | {', '.join(o.revs)} | {cell(o.n)} | {ch} | "
              f"`{cell(o.command or r.command or '—')}`; {', '.join(f'`{x}`' for x in o.raw)} |")
    p()
    p("### Plots")
    p()
    for name, title in PLOT_TITLES.items():
        p(f"![{title}](plots/{name}.png)")
        p()
        p(f"*{title}* — data: [`plots/{name}.csv`](plots/{name}.csv).")
        p()
    p("### Gaps in the raw lines")
    p()
    p("Fields a raw line lacks, filled from the log where it recorded them (bench drivers write them from "
      "issue 53 on):")
    p()
    for r, o, _ in computed:
        for g in o.gaps:
            p(f"- `{r.id}` ({', '.join(o.raw)}): {g}")
    p(END)
    return w.getvalue()


def render_readme(computed) -> str:
    w = io.StringIO()
    p = lambda *a: print(*a, file=w)  # noqa: E731
    p(RBEGIN)
    p("| what | result | measured on | code changed since |")
    p("|---|---|---|---|")
    for r, o, ch in computed:
        if r.readme and o.short:
            p(f"| [{cell(r.readme)}](docs/RESULTS.md#{r.id}) | {cell(o.short)} | {cell(o.machine.split(' (')[0])}, "
              f"{', '.join(o.revs[-1:])} | {ch.replace('**', '')} |")
    p(REND)
    return w.getvalue()


PLOT_TITLES = {
    "prefill-tok-s": "Prefill tok/s against prompt length, per GPU (DeepSeek-V4: extrapolated from 8 layers)",
    "bridge-cost": "Bridge cost against prompt length, by where the program runs",
    "ttft": "Time to first token, native against bridged",
}


def plot_data(computed) -> dict[str, list[tuple[str, float, float]]]:
    by_id = {r.id: o for r, o, _ in computed}
    data: dict[str, list] = {k: [] for k in PLOT_TITLES}
    for rid in ("speed.dsv4-flash-h100", "speed.dsv4-flash-h200", "speed.llama-1b-h100", "speed.llama-1b-h200"):
        for s, pts in by_id[rid].plot.items():
            data["prefill-tok-s"] += [(s, x, y) for x, y in pts]
    labels = {"bridge.llama-served-1gpu": "llama 1B, one GPU, served (H100, 0d966e5)",
              "bridge.dsv4-1gpu": "DeepSeek-V4 10 layers, one GPU (H100, 6fcb00c)",
              "bridge.llama-2gpu": "llama 1B, program on GPU 1 (2×H200, 967639a, older forward)",
              "bridge.dsv4-2gpu": "DeepSeek-V4 16 layers, program on GPU 1 (2×H200, 967639a, older forward)"}
    for rid, label in labels.items():
        for _, pts in by_id[rid].plot.items():
            data["bridge-cost"] += [(label, x, y * 100) for x, y in pts]
    for rid in ("served.ttft-cpu", "served.ttft-gpu"):
        for s, pts in by_id[rid].plot.items():
            data["ttft"] += [(s, x, y) for x, y in pts]
    return data


def csv_text(rows) -> str:
    w = io.StringIO()
    c = csv.writer(w, lineterminator="\n")
    c.writerow(["series", "T", "value"])
    for s, x, y in rows:
        c.writerow([s, x, f"{y:.6g}"])
    return w.getvalue()


def draw(data) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    units = {"prefill-tok-s": "tok/s", "bridge-cost": "extra wall time (%)", "ttft": "time to first token (s)"}
    for name, rows in data.items():
        series = list(dict.fromkeys(s for s, _, _ in rows))
        if name == "prefill-tok-s":  # two models, two scales: a panel each
            fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
            for ax, model in zip(axes, ("DeepSeek-V4", "llama")):
                for s in (t for t in series if t.startswith(model)):
                    pts = sorted((x, y) for t, x, y in rows if t == s)
                    ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=s.split(", ", 1)[1])
                ax.set_xscale("log")
                ax.set_xticks([8192, 32768, 131072], ["8K", "32K", "128K"])
                ax.minorticks_off()
                ax.set_ylim(bottom=0)
                ax.set_xlabel("prompt tokens (T)")
                ax.set_ylabel(units[name])
                ax.set_title("DeepSeek-V4-Flash (extrapolated from 8 layers)" if model == "DeepSeek-V4"
                             else "llama 1B forward", fontsize=9)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7, loc="lower left")
            fig.suptitle(PLOT_TITLES[name], fontsize=9)
            fig.tight_layout()
            fig.savefig(PLOTS / f"{name}.png", dpi=90, metadata={"Software": None})
            plt.close(fig)
            continue
        fig, ax = plt.subplots(figsize=(7, 4.2))
        if name == "bridge-cost":
            Ts = sorted({x for _, x, _ in rows})
            width = 0.8 / len(series)
            for i, s in enumerate(series):
                pts = {x: y for t, x, y in rows if t == s}
                ax.bar([Ts.index(x) + i * width for x in pts], list(pts.values()), width, label=s)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(Ts))], [tname(T) for T in Ts])
            ax.axhline(3, color="k", lw=0.8, ls="--")
            ax.text(len(Ts) - 0.6, 3.5, "3%", fontsize=7)
            ax.set_xlabel("prompt tokens (T)")
        else:
            for s in series:
                pts = sorted((x, y) for t, x, y in rows if t == s)
                ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=s)
            ax.set_xscale("log")
            if name == "ttft":
                ax.set_yscale("log")
            ax.set_xlabel("prompt tokens (T)")
        ax.set_ylabel(units[name])
        ax.set_title(PLOT_TITLES[name], fontsize=9)
        ax.grid(alpha=0.3)
        if name == "bridge-cost":
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1)
        else:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(PLOTS / f"{name}.png", dpi=90, metadata={"Software": None}, bbox_inches="tight")
        plt.close(fig)


def splice(text: str, begin: str, end: str, new: str, path: Path) -> str:
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < 0:
        raise SystemExit(f"{path}: the generated-block markers are missing")
    return text[:i] + new.rstrip("\n") + text[j + len(end):]


def recorded_asof(text: str) -> str | None:
    m = re.search(r"\*As of ([0-9a-f]{7,40}):", text)
    return m.group(1) if m else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 with a diff if the committed files differ")
    a = ap.parse_args()
    results_text = RESULTS_MD.read_text()
    readme_text = README_MD.read_text()
    head = git("rev-parse", "--short=7", "HEAD")
    asof = (recorded_asof(results_text) if a.check else None) or head
    if git("cat-file", "-e", f"{asof}^{{commit}}") is None:
        print(f"results: the tables' as-of revision {asof} is not in this clone's history", file=sys.stderr)
        return 1
    computed = compute_all(asof)
    want = {
        RESULTS_MD: splice(results_text, BEGIN, END, render_results(computed, asof), RESULTS_MD),
        README_MD: splice(readme_text, RBEGIN, REND, render_readme(computed), README_MD),
    }
    data = plot_data(computed)
    for name, rows in data.items():
        want[PLOTS / f"{name}.csv"] = csv_text(rows)
    if a.check:
        bad = 0
        for path, text in want.items():
            have = path.read_text() if path.exists() else ""
            if have != text:
                bad += 1
                sys.stdout.writelines(difflib.unified_diff(
                    have.splitlines(True), text.splitlines(True), f"{path.relative_to(ROOT)} (committed)",
                    f"{path.relative_to(ROOT)} (from bench/results/)"))
        if asof != head:
            moved = [r.id for r, o, _ in computed
                     if changed_since(min(o.revs, key=lambda v: commit_time(v) or 1 << 62), r.paths, head)
                     != changed_since(min(o.revs, key=lambda v: commit_time(v) or 1 << 62), r.paths, asof)]
            if moved:
                print(f"results: note: code measured by {', '.join(moved)} changed after {asof}; "
                      f"run scripts/results.py when next recording a result", file=sys.stderr)
        if bad:
            print(f"\nresults: {bad} file(s) differ from what bench/results/ gives: run scripts/results.py "
                  f"(a hand-edited number fails this check)", file=sys.stderr)
            return 1
        return 0
    for path, text in want.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    draw(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
