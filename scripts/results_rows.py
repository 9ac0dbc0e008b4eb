"""The rows of docs/RESULTS.md: every figure the project quotes as current, each with the small
function that computes it from its raw lines in bench/results/ (see scripts/results.py for the
choices). ROWS is the table; dynamic_rows() adds one row per fuzz and soak file."""

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

from results_lib import *  # noqa: F401,F403 (the rows read best with the helpers unqualified)
from results_lib import Out, Row  # noqa: F401

def r_dsv4_flash(files: str, gpu_note: str = "") -> Callable[[Row], Out]:
    def f(row: Row) -> Out:
        ls = [d for d in lines_of(files) if d.get("bridge") == "off"]
        by_T: dict[int, list[tuple[float, float]]] = {}
        gaps: list[str] = []
        command = command_of(ls, gaps) or row.command
        if not all("forward_arith" in d for d in ls):
            gaps.append("no arithmetic in the line (the DeepSeek-V4 GPU engine has only the fast forward: "
                        "FP8 projections, FP4 experts as stored)")
        if any(d.get("repeats") == 2 and "runs_wall_s" not in d for d in ls):
            gaps.append("the line's wall_s_median and implied_tok_s are the slower of 2 runs (recomputed here)")
        for d in ls:
            m, sp, n, _ = timed(d, "run_ms_median", "run_ms_min", "run_ms_max", "repeats")
            by_T.setdefault(d["T"], []).append((dsv4_implied_tok_s(d), sp))
        Ts = sorted(by_T)
        invocations = len({d["_file"] for d in ls})
        vals = " / ".join(span([v for v, _ in by_T[T]], fmt_int) for T in Ts)
        layers = ls[0]["layers"]
        value = (f"{vals} tok/s at {' / '.join(tname(T) for T in Ts)}, **extrapolated from {layers} "
                 f"layers** to the 43-layer mix")
        sp = max(s for T in Ts for _, s in by_T[T])
        n = (f"{ls[0]['repeats']} runs after {ls[0]['warmup']} warm-up per T"
             + (f", {invocations} invocations (range shown)" if invocations > 1 else "")
             + f"; spread ≤ {pct(sp, False)}")
        gpu = ls[0]["gpu"] + gpu_note
        revs = sorted({d["rev"] for d in ls})
        plot = {f"DeepSeek-V4-Flash, {gpu} ({'/'.join(revs)}), extrapolated from {layers} layers":
                [(T, statistics.mean(v for v, _ in by_T[T])) for T in Ts]}
        short = (f"{' / '.join(span([v for v, _ in by_T[T]], lambda x: f'{x / 1000:.1f}K') for T in Ts)} tok/s, "
                 f"extrapolated from {layers} layers")
        return Out(value, gpu, revs, n, sorted({d["_file"] for d in ls}), command, gaps, plot, short)
    return f


def r_llama_forward(files: str, attention_has: str = "") -> Callable[[Row], Out]:
    def f(row: Row) -> Out:
        ls = [d for d in lines_of(files) if d.get("mode") == "off" and attention_has in d.get("attention", "")]
        ls.sort(key=lambda d: d["T"])
        toks, shares, sps = [], [], []
        for d in ls:
            m, sp, n, recomputed = timed(d, "median_s", "min_s", "max_s", "repeat")
            toks.append(d["T"] / m if recomputed else d["tok_per_s"])  # odd n: the line's, unrounded
            shares.append(d["peak_fraction"])
            sps.append(sp)
        Ts = [d["T"] for d in ls]
        value = (f"{' / '.join(fmt_int(t) for t in toks)} tok/s at {' / '.join(tname(T) for T in Ts)}: "
                 f"{' / '.join(pct(s, False) for s in shares)} of the bf16 GEMM peak measured in the same "
                 f"run ({ls[0]['peak_tflops']} TFLOP/s); {ls[0]['attention']}, {ls[0]['kv']} cache")
        n = f"{ls[0]['repeat']} runs per T, one invocation; spread ≤ {pct(max(sps), False)}"
        gaps: list[str] = []
        command = command_of(ls, gaps) or row.command
        if "forward_arith" not in ls[0]:
            gaps.append("no arithmetic in the line (the fast forward: the bench runs no other)")
        if ls[0]["repeat"] > 3 and "runs_s" not in ls[0]:
            gaps.append(f"each run's value: the line keeps the median, min and max of {ls[0]['repeat']}")
        plot = {f"llama 1B, {ls[0]['gpu']} ({ls[0]['rev']})": list(zip(Ts, toks))}
        short = f"{' / '.join(f'{t / 1000:.0f}K' for t in toks)} tok/s ({' / '.join(pct(s, False) for s in shares)} of peak)"
        return Out(value, ls[0]["gpu"], [ls[0]["rev"]], n, sorted({d["_file"] for d in ls}), command, gaps,
                   plot, short)
    return f


def r_llama_cost(files: str, mode: str, rev_filter: str = "", program_device: int | None = None,
                 gpu_label: str = "") -> Callable[[Row], Out]:
    def f(row: Row) -> Out:
        ls = [d for d in lines_of(files) if (not rev_filter or d.get("rev") == rev_filter)
              and (program_device is None or d.get("program_device", -1) == program_device)]
        costs, sps, Ts = [], [], []
        for T in sorted({d["T"] for d in ls}):
            off = [d for d in ls if d["T"] == T and d["mode"] == "off"]
            on = [d for d in ls if d["T"] == T and d["mode"] == mode]
            if not off or not on:
                continue
            mo, so, n, r1 = timed(off[-1], "median_s", "min_s", "max_s", "repeat")
            mn, sn, _, r2 = timed(on[-1], "median_s", "min_s", "max_s", "repeat")
            # odd n: the line's own ratio, from its unrounded medians
            costs.append(mn / mo - 1 if r1 or r2 else on[-1]["overhead_vs_off"])
            sps += [so, sn]
            Ts.append(T)
        d0 = ls[0]
        gpu = gpu_label or d0.get("machine") or d0["gpu"]
        value = f"{' / '.join(pct(c) for c in costs)} at {' / '.join(tname(T) for T in Ts)}"
        n = f"{d0['repeat']} runs per leg and T, legs in one invocation; spread ≤ {pct(max(sps), False)}"
        gaps: list[str] = []
        command = command_of(ls, gaps) or row.command
        if d0["repeat"] > 3 and "runs_s" not in d0:
            gaps.append(f"each run's value: the line keeps the median, min and max of {d0['repeat']}")
        return Out(value, gpu, [d0["rev"]], n, sorted({d["_file"] for d in ls}), command, gaps,
                   {row.id: list(zip(Ts, costs))}, f"{' / '.join(pct(c) for c in costs)} at {' / '.join(tname(T) for T in Ts)}")
    return f


def r_dsv4_cost(files: str, rev_filter: str = "", on: str = "on", gpu_label: str = "") -> Callable[[Row], Out]:
    def f(row: Row) -> Out:
        ls = [d for d in lines_of(files) if not rev_filter or d.get("rev") == rev_filter]
        costs, sps, Ts, recomputed = [], [], [], False
        for T in sorted({d["T"] for d in ls}):
            a = [d for d in ls if d["T"] == T and d["bridge"] == "off"]
            b = [d for d in ls if d["T"] == T and d["bridge"] == on]
            if not a or not b:
                continue
            mo, so, n, r1 = timed(a[-1], "wall_s_median", "wall_s_min", "wall_s_max", "repeats")
            mn, sn, _, r2 = timed(b[-1], "wall_s_median", "wall_s_min", "wall_s_max", "repeats")
            recomputed |= r1 or r2
            costs.append(mn / mo - 1 if r1 or r2 else b[-1]["bridge_overhead_vs_off"])
            sps += [so, sn]
            Ts.append(T)
        d0 = ls[0]
        gaps: list[str] = []
        command = command_of(ls, gaps) or row.command
        if recomputed:
            gaps.append("bridge_overhead_vs_off compares the slower of 2 runs of each leg (recomputed "
                        "here from both runs' mean)")
        value = (f"{' / '.join(pct(c) for c in costs)} at {' / '.join(tname(T) for T in Ts)} "
                 f"({d0['layers']} layers, measured, not extrapolated)")
        n = f"{d0['repeats']} runs per leg and T, legs in one invocation; spread ≤ {pct(max(sps), False)}"
        return Out(value, gpu_label or d0.get("machine") or d0["gpu"], [d0["rev"]], n,
                   sorted({d["_file"] for d in ls}), command, gaps, {row.id: list(zip(Ts, costs))},
                   f"{' / '.join(pct(c) for c in costs)} at {' / '.join(tname(T) for T in Ts)}")
    return f


def slower_forward(then_tok_s: float, now_row: str, T: int) -> str:
    now = {r.id: r for r in ROWS}[now_row]
    pts = now.compute(now).plot
    now_tok = dict(next(iter(pts.values())))[T]
    return f"{now_tok / then_tok_s:.1f}×"


def r_two_gpu_llama(row: Row) -> Out:
    o = r_llama_cost("gpu_bridge_cost_llama-h200.jsonl", "on", "967639a", 1)(row)
    off8 = [d for d in lines_of("gpu_bridge_cost_llama-h200.jsonl", rev="967639a") if d["mode"] == "off"
            and d["T"] == 8192][0]
    o.value += (f"; measured with a forward {slower_forward(off8['tok_per_s'], 'speed.llama-1b-h100', 8192)} "
                f"slower than today's ({fmt_int(off8['tok_per_s'])} tok/s at 8K, FP8 cache, own attention, "
                f"against speed.llama-1b-h100)")
    o.short = f"{o.short} (with a forward {slower_forward(off8['tok_per_s'], 'speed.llama-1b-h100', 8192)} slower than today's)"
    return o


def r_two_gpu_dsv4(row: Row) -> Out:
    o = r_dsv4_cost("gpu_bridge_cost_dsv4-h200.jsonl", "967639a")(row)
    off8 = [d for d in lines_of("gpu_bridge_cost_dsv4-h200.jsonl", rev="967639a") if d["bridge"] == "off"
            and d["T"] == 8192][0]
    then = dsv4_implied_tok_s(off8)
    o.value += (f"; FP8 experts, bf16 projections; measured with a forward "
                f"{slower_forward(then, 'speed.dsv4-flash-h100', 8192)} slower than today's "
                f"({fmt_int(then)} against speed.dsv4-flash-h100's extrapolated tok/s at 8K)")
    o.short = f"{o.short} (forward {slower_forward(then, 'speed.dsv4-flash-h100', 8192)} slower than today's)"
    return o


def r_dsv4_implied_cost(row: Row) -> Out:
    ls = lines_of("gpu_dsv4_bridge_copies-h100-c080dca-c1.jsonl")
    parts, Ts = [], []
    for T in sorted({d["T"] for d in ls}):
        e = [d for d in ls if d["T"] == T and d["bridge"] == "on-engine"][0]
        parts.append(pct(e["implied_43_layer_overhead"]))
        Ts.append(T)
    value = (f"{' / '.join(parts)} at {' / '.join(tname(T) for T in Ts)}, **extrapolated from 10 layers** "
             f"(the forward's slowdown plus the last layers' tail once against 43/10 of the forward; the "
             f"program on the engine's stream)")
    gaps = ["revision: the lines say \"build\" (c080dca's binary, log §49)", "no command in the line (from the log)",
            "two-run medians are the slower run, and the line keeps no faster tail: not recomputable"]
    return Out(value, ls[0]["gpu"], ["c080dca"], f"{ls[0]['repeats']} runs per leg, one invocation",
               sorted({d["_file"] for d in ls}), row.command, gaps)


def r_pipeline34(kind: str) -> Callable[[Row], Out]:
    def f(row: Row) -> Out:
        ls = [d for d in lines_of("gpu_dsv4_pipeline_34layers_chunks-718986e.jsonl") if d["chunk"] == 32768]
        Ts = sorted({d["T"] for d in ls})
        if kind == "speed":
            v = [next(d["tok_s"] for d in ls if d["T"] == T and d["bridge"] == "off") for T in Ts]
            value = (f"{' / '.join(fmt_int(x) for x in v)} tok/s for 34 layers (measured) at "
                     f"{' / '.join(tname(T) for T in Ts)}, engine chunks of 32,768 over the decoder's 2,048-token calls")
        else:
            v = [next(d["bridge_cost_vs_off"] for d in ls if d["T"] == T and d["bridge"] == "on") for T in Ts]
            value = f"{' / '.join(pct(x) for x in v)} at {' / '.join(tname(T) for T in Ts)} (34 layers, program on the same GPU)"
        return Out(value, ls[0]["gpu"], [ls[0]["rev"]], "1 timed run after 1 warm-up (n = 1)",
                   ["gpu_dsv4_pipeline_34layers_chunks-718986e.jsonl"], row.command,
                   ["no command in the line (from the log)", "no arithmetic in the line (fast: checkpoint precision)"])
    return f


def r_wire_host(row: Row) -> Out:
    ls = lines_of("wire_segment-h100-host-c080dca.jsonl")
    v1 = next(d for d in ls if d["rev"] == "out-base")
    v2 = next(d for d in ls if d["rev"] == "build")
    value = (f"{v2['encode_tagged_ms_median']} ms ({v2['encode_tagged_ms_min']}–{v2['encode_tagged_ms_max']}) to "
             f"frame and tag one 268 MB llama-1B 8K segment as served, on {v2['threads']} threads (wire 2), against "
             f"{v1['encode_ms_median']} + {v1['tag_ms']} ms on one thread (wire 1, 0039afd)")
    gaps = ["revision: the lines say \"build\" and \"out-base\" (c080dca and 0039afd, log §49)",
            "no machine or GPU in the line (the H100 machine's 16-core host, log §49)",
            "no command in the line (from the log)"]
    return Out(value, "H100 machine's host (16 cores)", ["c080dca"], f"{v2['repeat']} runs (median, min–max)",
               ["wire_segment-h100-host-c080dca.jsonl"], row.command, gaps,
               short=f"{v2['encode_tagged_ms_median']} ms (was {v1['encode_ms_median'] + v1['tag_ms']:.0f})")


# --- correctness


def backend(d: dict) -> str:
    b = d.get("prefill_backend") or "cpu"
    return b.get("name", "cpu") if isinstance(b, dict) else b


def verify_lines(pattern: str) -> list[dict]:
    return [d for d in lines_of(pattern) if "arrays" in d]


def r_verify(pattern: str, what: str, gpu: str = "", gpu_gap: str = "") -> Callable[[Row], Out]:
    def f(row: Row) -> Out:
        ls = verify_lines(pattern)
        passed = sum(1 for d in ls if d.get("pass"))
        ba = sum(d["arrays"]["bit_exact"] for d in ls)
        na = sum(d["arrays"]["count"] for d in ls)
        ident = sum(1 for d in ls if d["continuation"]["identical"])
        proc = sorted({d["decoder_accounting"]["bridged"].get("processed") for d in ls})
        Ts = sorted({d["T"] for d in ls})
        revs = sorted({d.get("revision") or d.get("rev") for d in ls})
        value = (f"{passed} of {len(ls)} {what} pass: {ba} of {na} cache arrays bit-exact, continuation identical "
                 f"in {ident} of {len(ls)}, the decoder processed {'/'.join(map(str, proc))} prompt token(s) "
                 f"(T {Ts[0]:,}–{Ts[-1]:,})")
        machine, command = gpu, row.command
        gaps = []
        env = [p for p in raw_files(pattern.replace(".jsonl", ".env.txt"))]
        if env:  # written beside the lines by bench/gpu/e2e_device.sh
            txt = env[0].read_text()
            m = re.search(r"^gpu: (.*)$", txt, re.M)
            machine = m.group(1).split(",")[0] if m else machine
            m = re.search(r"^command: (.*)$", txt, re.M)
            command = m.group(1) if m else command
        elif gpu_gap:
            gaps.append(gpu_gap)
        return Out(value, machine or "CPU machine (2 cores)", revs, f"{len(ls)} prompts, one run each",
                   sorted({d["_file"] for d in ls}) + [p.name for p in env], command, gaps,
                   short=f"{passed} of {len(ls)}, {ba}/{na} arrays bit-exact")
    return f


def r_quantized(row: Row) -> Out:
    parts, files, revs, short = [], [], set(), []
    for tag, label in (("q4", "4-bit affine"), ("q8", "8-bit affine"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp8")):
        label_short = label.split(" ")[0]
        ls = [d for d in verify_lines(f"verify-{tag}-*.jsonl") if backend(d) == "cpu"]
        best = {}
        for d in ls:  # one per prompt: a pass anywhere counts; the files are per revision
            if d.get("pass") or d["prompt"] not in best:
                best[d["prompt"]] = d
        ok = sum(1 for d in best.values() if d.get("pass"))
        parts.append(f"{label}: {ok} of {len(best)} chat prompts")
        short.append(f"{label_short} {ok}/{len(best)}")
        files += sorted({d["_file"] for d in ls})
        revs |= {d["revision"] for d in best.values()}
    value = ("; ".join(parts) + " — every cache array bit-exact against the quantized decoder's own, the "
             "continuation identical, 1 prompt token processed. 2-bit affine: never run")
    return Out(value, "CPU machine (2 cores)", sorted(revs, key=commit_time), "one run per prompt",
               files, row.command, [], short=", ".join(short) + " prompts bit-exact (2-bit untested)")


def r_fast_real(row: Row) -> Out:
    ls = verify_lines("verify-real-gpu-fast-h200-*.jsonl")
    eq = [d["arrays"].get("equal_fraction") for d in ls if d["arrays"].get("equal_fraction") is not None]
    cos = [d["arrays"]["min_cosine"] for d in ls]
    ident = sum(1 for d in ls if d["continuation"]["identical"])
    conf = sum(1 for d in ls if (d.get("verdict") or {}).get("confirmed"))
    value = (f"{len(ls)} bridges, {conf} confirmed by the decoder; cache elements equal to the decoder's "
             f"{span(eq, lambda x: f'{x * 100:.0f}%')} (where recorded), min cosine {min(cos):.4f}; greedy "
             f"continuation identical in {ident} of {len(ls)} — within a tolerance, not the decoder's bits")
    gaps = [] if len(eq) == len(ls) else [f"{len(ls) - len(eq)} of {len(ls)} lines lack equal_fraction (36b809e)"]
    return Out(value, "NVIDIA H200", sorted({d["revision"] for d in ls}, key=commit_time),
               "one run per prompt", sorted({d["_file"] for d in ls}), row.command, gaps)


def r_dsv4_gpu_verify(row: Row) -> Out:
    ls = verify_lines("verify-dsv4-gpu-*.jsonl")
    cos = [d["arrays"]["min_cosine"] for d in ls]
    ident = sum(1 for d in ls if d["continuation"]["identical"])
    conf = sum(1 for d in ls if (d.get("verdict") or {}).get("confirmed"))
    value = (f"{conf} of {len(ls)} bridges confirmed by the decoder (1 prompt token processed); arrays' min "
             f"cosine {min(cos):.4f}–{max(cos):.4f}; continuation identical in {ident} of {len(ls)} (random tiny "
             f"model: fast arithmetic, within a tolerance)")
    return Out(value, "NVIDIA H200", sorted({d["revision"] for d in ls}), "one run per prompt",
               sorted({d["_file"] for d in ls}), row.command,
               ["no GPU name in the line (the H200, log §16.7)"])


def r_pytest_file(test_file: str, what: str) -> Callable[[Row], Out]:
    def f(row: Row) -> Out:
        p = raw_files("pytest-durations-*.log")[-1]
        rev = p.stem.split("-")[-1]
        txt = p.read_text()
        passed = len(re.findall(rf"^\S+ tests/py/{re.escape(test_file)}::\S+.* PASSED", txt, re.M))
        failed = len(re.findall(rf"^\S+ tests/py/{re.escape(test_file)}::\S+.* (FAILED|ERROR)", txt, re.M))
        value = f"{passed} passed, {failed} failed in tests/py/{test_file}: {what}"
        return Out(value, "CPU machine (2 cores)", [rev], "one run (pytest -v, one worker)", [p.name],
                   row.command, ["the only raw pytest log (ea48e07): later CI runs kept counts in the log's prose"],
                   short=f"{passed} of {passed + failed} bit-exact")
    return f


def r_gpu_suite(row: Row) -> Out:
    p = max(raw_files("gpu_tests-h*-*.log"), key=lambda q: commit_time(q.stem.split("-")[-1]))
    txt = p.read_text()
    ran = re.search(r"(\d+) tests from \d+ test suites ran", txt)
    ok = re.search(r"\[  PASSED  \] (\d+) tests", txt)
    sk = re.search(r"\[  SKIPPED \] (\d+) tests", txt)
    fl = re.search(r"\[  FAILED  \] (\d+) tests", txt)
    rev = p.stem.split("-")[-1]
    gpu = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}.get(p.stem.split("-")[1], p.stem)
    value = (f"{ok.group(1) if ok else 0} of {ran.group(1) if ran else '?'} passed, "
             f"{sk.group(1) if sk else 0} skipped (they need two GPUs), {fl.group(1) if fl else 0} failed")
    return Out(value, gpu, [rev], "one run", [p.name], row.command,
               ["GPU name from the file's name (the log holds none)"], short=value.split(",")[0])


# --- long context, served


def r_memory_llama(row: Row) -> Out:
    rows = []
    for pat, arith in (("memory-gpu-h200-bd42cc6.jsonl", "fast"), ("memory-gpu-h200-exact-*.jsonl", "exact")):
        for d in lines_of(pat):
            conf = (f"decoder reused {d['cached_tokens']:,}" if "cached_tokens" in d
                    else "confirmation not in the line (log §20.2: 271,718 reused)")
            rows.append((d, arith, conf))
    parts = [f"T {d['T']:,} ({arith}): {d['verdict']}, {conf}; prefill {d['bridged_timings_ms']['prefill'] / 1000:.1f} s, "
             f"first token {d['ttft_s']:.1f} s" for d, arith, conf in rows]
    gaps = ["no GPU name in the lines (the H200, log §20.2)",
            "no arithmetic in the lines (fast and exact, set by HETERO_PREFILL_ARITH; log §20.2)",
            "bd42cc6's line lacks cached_tokens (its confirmation is in the log only)"]
    return Out("; ".join(parts), "NVIDIA H200 (prefill), its CPU (decoder)", [d["revision"] for d, _, _ in rows],
               "one run each", sorted({d["_file"] for d, _, _ in rows}), row.command, gaps,
               short=f"{rows[0][0]['T']:,} tokens complete; first token {rows[0][0]['ttft_s']:.1f} s (fast), "
                     f"{rows[1][0]['ttft_s']:.0f} s (exact)")


def r_memory_dsv4(row: Row) -> Out:
    ls = sorted(lines_of("memory-dsv4-gpu-h200-*c0843d7.jsonl"), key=lambda d: d["T"])
    parts = [f"{d['T']:,}: prefill {d['bridged_timings_ms']['prefill'] / 1000:.2g} s, first token {d['ttft_s']:.1f} s"
             for d in ls]
    conf = all(d.get("cached_tokens") == d["T"] - 1 for d in ls)
    value = (f"{len(ls)} sizes, all `{ls[0]['verdict']}`" + (", each confirmed by the decoder (T − 1 reused)" if conf else "")
             + " — " + "; ".join(parts) + " (4-layer test model, fast arithmetic)")
    gaps = ["no GPU name or arithmetic in the lines (the H200, `--arith fast`; log §23)",
            "no command in the lines (from the log)"]
    return Out(value, "NVIDIA H200 (prefill), its CPU (decoder)", [ls[0]["revision"]], "one run each",
               sorted({d["_file"] for d in ls}), row.command, gaps,
               short=f"to {ls[-1]['T']:,} tokens, complete; prefill {ls[-1]['bridged_timings_ms']['prefill'] / 1000:.0f} s at 2M")


def r_memory_front(row: Row) -> Out:
    ls = sorted(lines_of("memory-0b99fa3.jsonl"), key=lambda d: d["T"])
    d = ls[-1]
    value = (f"at T {d['T']:,}: the front door grows by {d['front_growth_over_cache']:.2f}× the cache, the "
             f"decoder by {d['decoder_growth_over_cache']:.2f}× (its own native request: "
             f"{d['decoder_native_growth_over_cache']:.2f}×), the prefill host {d['prefill_growth_over_cache']:.2f}×")
    return Out(value, "CPU machine (2 cores)", ["0b99fa3"], "one request per size", ["memory-0b99fa3.jsonl"],
               row.command, ["no command in the line (from the log)",
                             f"the line names {d['revision']}; the file and log §20.1 name 0b99fa3, its code"])


def r_warm(pattern: str, label: str) -> Callable[[Row], Out]:
    def f(row: Row) -> Out:
        ls = sorted(lines_of(pattern), key=lambda d: d["turn"])
        ok = sum(1 for d in ls if d["bridged"]["verdict"] == "complete" and d["bridged"].get("confirmed"))
        eq = [d for d in ls if d.get("answer_equal") is not None]
        same = sum(1 for d in eq if d["answer_equal"])
        last = ls[-1]
        value = (f"{len(ls)} turns to T {last['T']:,}: {ok} bridged `complete` and confirmed, {same} of {len(eq)} "
                 f"answers equal to the decoder's own; turn {last['turn']} computed {last['bridged']['computed']:,} "
                 f"tokens and sent {last['bridged']['bytes']:,} bytes ({label})")
        gaps = ["no GPU name or arithmetic in the lines (from the log)"] if "h200" in pattern else []
        if last["rev"] not in pattern:
            gaps.append(f"the lines name {last['rev']}, the HEAD when the script ended (log)")
        return Out(value, "NVIDIA H200 (prefill), its CPU (decoder)" if "h200" in pattern else "CPU machine (2 cores)",
                   [last["rev"]], "one run, n = 1 per turn", sorted({d["_file"] for d in ls}), row.command, gaps)
    return f


def r_verdicts(row: Row) -> Out:
    s = [d for d in lines_of("verdicts-*.jsonl") if d.get("bench") == "verdicts" and "mismatches" in d]
    req = sum(d["requests"] for d in s)
    value = (f"{sum(d['mismatches'] for d in s)} of {req} verdicts disagree with the decoder's own `cached_tokens`, "
             f"{sum(d['metric_mismatches'] for d in s)} `/metrics` disagreements ({len(s)} runs: "
             + ", ".join(f"{d['requests']} on {Path(d['model']).name}" for d in s) + ")")
    return Out(value, "CPU machine (2 cores)", sorted({d["rev"] for d in s}), f"{len(s)} runs, one each",
               sorted({d["_file"] for d in s}), row.command, ["no machine in the summary lines"],
               short=f"0 of {req} disagree" if all(d["mismatches"] == 0 for d in s) else "")


def r_cold(pattern: str, rev_fix: str = "") -> Callable[[Row], Out]:
    def f(row: Row) -> Out:
        ls = sorted(lines_of(pattern), key=lambda d: d["T"])
        ratios = [d["ttft_ratio"] for d in ls]
        value = (f"bridged first token {span(ratios, lambda x: f'{x:.1f}×')} sooner than native at T "
                 f"{ls[0]['T']:,}–{ls[-1]['T']:,} (every bridged verdict `complete`"
                 + (")" if all(d["bridged_verdict"] == "complete" for d in ls) else "; not all)"))
        gaps = ["no command in the line (from the log)"]
        if rev_fix:
            gaps.append(f"the lines' revision reads {ls[0]['revision']} (the carried kit's); the binary was "
                        f"{rev_fix} (log §12)")
        machine = ls[0].get("gpu") or "CPU machine (2 cores)"
        if ls[0].get("gpu"):
            plot = {"native: the decoder alone, on the GPU machine's CPU": [(d["T"], d["native_ttft_s"]) for d in ls],
                    f"bridged: prefill on the {machine.replace('NVIDIA ', '')} ({ls[0].get('prefill_arith')})":
                    [(d["T"], d["bridged_ttft_s"]) for d in ls]}
        else:
            plot = {"native: the decoder alone, CPU machine": [(d["T"], d["native_ttft_s"]) for d in ls],
                    "bridged: CPU engine, same 2 cores": [(d["T"], d["bridged_ttft_s"]) for d in ls]}
        return Out(value + f"; {ls[0]['model']}", machine, [rev_fix or ls[0]["revision"]],
                   f"{ls[0]['repeat']} request per leg and size", [Path(ls[0]["_file"]).name], row.command, gaps, plot,
                   short=f"{span(ratios, lambda x: f'{x:.1f}×')} sooner at T {ls[0]['T']:,}–{ls[-1]['T']:,}")
    return f


def r_at_once(row: Row) -> Out:
    ls = [d for d in lines_of("bridges-at-once-*.jsonl") if "ratio" in d]
    newest = max({d["rev"] for d in ls}, key=commit_time)
    cur = [d for d in ls if d["rev"] == newest]
    value = (f"8 cold bridges at once took {span([d['ratio'] for d in cur], lambda x: f'{x:.2f}×')} the wall time of "
             f"8 one after another ({len(cur)} rounds; every answer the decoder's own: "
             f"{'yes' if all(d['ok'] for d in cur) else 'no'})")
    return Out(value, "NVIDIA H200 (prefill, exact), its CPU (decoder)", [newest], f"{len(cur)} rounds",
               sorted({d["_file"] for d in cur}), row.command,
               ["no GPU name in the lines (the H200, log §22.6)", "no command in the lines (from the log)"])


def r_short_behind_long(row: Row) -> Out:
    cpu = [d for d in lines_of("short-behind-long-smollm2-*.jsonl") if "short_gain" in d]
    gpu = [d for d in lines_of("short-behind-long-h200-*.jsonl") if "short_gain" in d]
    value = (f"a short prompt behind a long one answered {span([d['short_gain'] for d in cpu], lambda x: f'{x:.1f}×')} "
             f"sooner with the prefill host's turns (CPU, {len(cpu)} runs) and {gpu[0]['short_gain']:.1f}× (H200, "
             f"113K-token long prompt, 1 run); same answers")
    return Out(value, "CPU machine; NVIDIA H200", sorted({d["rev"] for d in cpu + gpu}), f"{len(cpu)} + {len(gpu)} runs",
               sorted({d["_file"] for d in cpu + gpu}), row.command, ["no GPU name in the H200 line (log §22.7)"])


def r_cpu_prefill(row: Row) -> Out:
    ls = sorted(lines_of("prefill_cpu.jsonl"), key=lambda d: d["tokens"])
    speedups = " / ".join(f"{d['speedup']:.1f}×" for d in ls)
    value = (f"our engine + program + wire {speedups} faster than mlx-lm's prefill "
             f"at {' / '.join(str(d['tokens']) for d in ls)} tokens, same CPU, same run (cache bit-exact: "
             f"{'yes' if all(d['refcheck'] for d in ls) else 'no'})")
    return Out(value, "CPU machine (2 cores)", [ls[0]["revision"]], f"{ls[0]['repeat']} run per size, legs alternating",
               ["prefill_cpu.jsonl"], row.command, ["no command in the line (from the log)"])


# --- hardening: every fuzz and soak file, newest revision first


def fuzz_rev(p: Path) -> str:
    m = re.match(r"fuzz-([0-9a-f]{7,40})", p.name)
    return m.group(1) if m else ""


def r_fuzz(p: Path) -> Callable[[Row], Out]:
    def f(row: Row) -> Out:
        txt = p.read_text(errors="replace")
        sections = re.split(r"^== ", txt, flags=re.M)[1:]
        done, findings, incomplete = [], [], []
        for s in sections:
            name = s.splitlines()[0].strip()
            runs = re.search(r"number_of_executed_units:\s+(\d+)", s)
            ex = re.search(r"^(?:exit|Exit status:) (\d+)", s, re.M)
            res = re.search(r"^result: (.*)$", s, re.M)
            if name.startswith("superseded"):
                continue
            if ex and ex.group(1) != "0":
                findings.append(f"{name.split(' (')[0]}: {(res.group(1) if res else 'exit ' + ex.group(1))[:90]}…")
            elif runs and ex:
                done.append((name, int(runs.group(1))))
            else:
                incomplete.append(name)
        runs = sorted({r for _, r in done})
        lenient = [n for n, _ in done if re.search(rf"^# {n} ran with HETERO_FUZZ_LENIENT_JSON=1", txt, re.M)]
        value = (f"{len(done)} targets × {'/'.join(f'{r:,}' for r in runs)} runs, 0 crashes, leaks or UB: "
                 + ", ".join(n + (" (lenient JSON error bodies)" if n in lenient else "") for n, _ in done))
        if findings:
            value += "; a stricter run stopped on a finding: " + "; ".join(findings)
            value += " " + "".join(v for k, v in FIXED.items() if any(k in f for f in findings))
        if incomplete:
            value += f"; still running or cut: {', '.join(incomplete)}"
        head = txt.splitlines()[0] if txt else ""
        cmd = re.search(r"^# command: (.*)$", txt, re.M)
        return Out(value, "CPU machine (2 cores), ASan+UBSan" if "ASan" in head else "CPU machine (2 cores)",
                   [fuzz_rev(p)], "one run per target", [p.name], cmd.group(1) if cmd else row.command, [],
                   short=(f"{len(done)} targets × {runs[-1]:,} runs, 0 crashes"
                          + (f"; {len(findings)} finding(s) in a stricter run, fixed" if findings else "")) if runs else "")
    return f


def r_soak(p: Path) -> Callable[[Row], Out]:
    def f(row: Row) -> Out:
        ls = jsonl(p)
        summ = [d for d in ls if d.get("bench") == "soak"]
        reqs = [d for d in ls if "kind" in d]
        rev = p.stem.split("-", 1)[1]
        if not summ:
            return Out(f"in progress or cut off: {len(reqs)} requests recorded, no summary line yet", "—", [rev],
                       "—", [p.name], row.command, ["no summary line"])
        parts, short = [], ""
        for s in summ:
            lat = s["latency_s"]
            sp99 = max(lat.get(k, {}).get("p99") or 0 for k in ("short", "short-stream")
                       if not math.isnan(lat.get(k, {}).get("p99") or 0))
            phase = s.get("phase", "front")
            where = "through the front door" if phase == "front" else "straight at the decoder"
            parts.append(f"{where}: {s['requests']} requests, {s['errors']} error(s), short p99 {sp99:.0f} s, "
                         f"front RSS max {s['rss']['front']['max_mib']:.0f} MiB")
            if s.get("abusive_clients"):  # issue 50's soak: abusive clients beside the 64
                parts[-1] += (f", {sum(s['abuses'].values())} abuses from {s.get('abusive_clients', 0)} clients "
                              f"({s.get('abuses_not_refused', 0)} not refused)")
            if "child_restarts" in s:
                parts[-1] += f", {s['child_restarts']:g} child restarts"
            if phase == "front":
                short = f"{s['requests']} requests, {s['errors']} error(s)" + (
                    f"; {sum(s['abuses'].values())} abuses from {s['abusive_clients']} abusive clients, "
                    f"{s.get('abuses_not_refused', 0)} not refused" if s.get("abusive_clients") else "")
        s = summ[0]
        value = f"{s['clients']} openai clients, {s.get('minutes_of_requests', 10):g} min: " + "; ".join(parts)
        return Out(value, f"CPU machine ({s.get('cpus', '?')} cores), {s['model']}", [rev],
                   "one run per phase (n = 1)", [p.name],
                   row.command, ["no command in the line (from the log)"], short=short)
    return f


# A finding a fuzz file records, and where it was fixed (the raw file cannot say).
FIXED = {"http_server, strict": "(fixed in 6e55575: the server quotes targets escaped and no exception leaves a "
         "connection's thread; docs/log/51-hardening-second-round.md)"}


def dynamic_rows() -> list[Row]:
    rows = []
    for p in sorted(raw_files("fuzz-*.txt"), key=lambda q: -commit_time(fuzz_rev(q))):
        rev = fuzz_rev(p)
        rows.append(Row(f"hardening.fuzz-{p.stem[5:]}", "hardening", f"libFuzzer targets ({p.name})",
                        "each target's runs from its seeds; a crash, a leak or undefined behaviour stops it",
                        ["fuzz", "src/common", "src/bridge", "src/front", "src/prefill", "src/decode"],
                        r_fuzz(p), command="cd build-fuzz && ./hetero_fuzz_<target> -runs=1000000 -max_len=65536 "
                        "-print_final_stats=1 <copy of its corpus>", readme="fuzzing" if p.name.endswith("-1m.txt") else ""))
    fuzz_ids = [r.id for r in rows]
    for r in rows[1:]:
        r.status = f"older: see {fuzz_ids[0]}"
    soaks = sorted(raw_files("soak-*.jsonl"), key=lambda q: -commit_time(q.stem.split("-", 1)[1]))
    for i, p in enumerate(soaks):
        rows.append(Row(f"hardening.soak-{p.stem[5:]}", "hardening", f"soak ({p.name})",
                        "64 threads, each its own official openai client (no retries), closed-loop, long "
                        "(bridged) and short prompts, streamed or not, on `hetero up` (2 cores)",
                        SERVED + ["src/common"], r_soak(p),
                        command="PYTHONPATH=python .venv/bin/python bench/soak.py --minutes 10 --clients 64 "
                        "(log §15.3)", readme="soak" if i == 0 else "",
                        status="current" if i == 0 else f"older: see hardening.soak-{soaks[0].stem[5:]}"))
    return rows


# --- the test suite


def r_ci(row: Row) -> Out:
    # No raw line: the fresh-clone CI runs were timed by `date` and recorded in the log only.
    value = ("37 min on 2 cores (a43631f, fresh clone, `CI=true bash .ci/run`, rc 0): ctest 171 unit tests "
             "passed, its 113 GPU tests skipped (no GPU), pytest 526 passed in 25.6 min on 2 workers")
    return Out(value, "CPU machine (2 cores)", ["a43631f"], "one run", ["—"], row.command,
               ["no raw line: the time and counts are in log §50's prose only"],
               short="37 min, 526 pytest + 171 unit tests (2 cores, fresh clone)")


def r_pytest_time(row: Row) -> Out:
    p = raw_files("pytest-durations-*.log")[-1]
    m = re.search(r"(\d+) passed in ([\d.]+)s", p.read_text())
    return Out(f"{m.group(1)} passed in {float(m.group(2)) / 60:.1f} min on one worker (where the time goes: the "
               f"decoder prefilling ≥ 4,000-token prompts natively on MLX's CPU backend)", "CPU machine (2 cores)",
               [p.stem.split("-")[-1]], "one run (an upper bound: other work shared the machine)", [p.name],
               row.command, [])


C = "log §"  # where a command constant comes from

ROWS: list[Row] = [
    # correctness
    Row("correct.llama-exactness", "correctness", "llama cache arrays, bit for bit",
        "the decoder's own attention inputs → our program, and our CPU engine → program → wire → mount, "
        "against the decoder's native cache: every array, no tolerance; llama/qwen2/qwen3/mistral, every "
        "rope mlx-lm builds, quantized; T ∈ {1 … 5003}, uneven chunkings (rerun by every `make test`: "
        "`tests.ci`)", EXACT_CPU,
        r_pytest_file("test_exactness.py", "same input and end to end"),
        command="make tiny && HETERO_TOKENIZER=models/smollm2-135m-instruct .venv/bin/python -m pytest "
        "tests/py/test_exactness.py (log §1–2)", readme="llama cache arrays (sweep)"),
    Row("correct.dsv4-exactness", "correctness", "DeepSeek-V4 cache arrays and attention inputs, bit for bit",
        "window, compressor and indexer pools, buffers, slot index against mlx-vlm's; the CPU engine's attention "
        "inputs against the decoder's, per layer (rerun by every `make test`)", EXACT_CPU,
        r_pytest_file("test_dsv4_exactness.py", "same input, call schedules incl. the chunk-dependent overlap rule"),
        command="HETERO_DSV4_MODEL=models/dsv4-tiny PYTHONPATH=python .venv/bin/python -m pytest "
        "tests/py/test_dsv4_exactness.py tests/py/test_dsv4_forward.py (log §9)"),
    Row("correct.chat-cpu", "correctness", "five real chat prompts, CPU engine",
        "`hetero verify`: native request, then bridged; cache arrays compared, 64 greedy tokens; SmolLM2-135M's "
        "real weights", EXACT_CPU + SERVED, r_verify("verify-9b66cb8.jsonl", "prompts"),
        command=".venv/bin/python bench/verify_prompts.py --chunks 7,512,13,100 (log §3)", readme="five real chat prompts (CPU)"),
    Row("correct.chat-gpu-exact", "correctness", "six prompts, exact CUDA engine, real weights",
        "`hetero verify --backend cuda` (exact arithmetic) on SmolLM2-135M's real weights, the 4,702-token "
        "prompt included; decoder mlx-lm on the GPU machine's CPU", LLAMA_GPU + BRIDGE_GPU + SERVED,
        r_verify("verify-real-gpu-exact-h200-*.jsonl", "prompts"), readme="the same from the GPU (exact)"),
    Row("correct.quantized", "correctness", "mlx-lm-quantized llama decoders, real weights",
        "`mlx_lm.convert -q` of the default model; `hetero verify` per chat prompt, the prefill host running "
        "the same quantized checkpoint (CPU backend)", EXACT_CPU + SERVED, r_quantized,
        command="python bench/verify_prompts.py --quantize 4|8|4,32,mxfp4|8,32,mxfp8 --tag TAG --max-tokens 32 "
        "(log §17.3, §28)", readme="quantized decoders"),
    Row("correct.dsv4-chat-cpu", "correctness", "DeepSeek-V4 end to end, five chat prompts (tiny checkpoint)",
        "FP8 checkpoint → our CPU forward → program → wire → mount into mlx-vlm's prefix cache", EXACT_CPU + SERVED,
        r_verify("verify-dsv4-6cbb4da.jsonl", "prompts"),
        command="python bench/verify_prompts.py --model models/dsv4-tiny/native --prefill-model "
        "models/dsv4-tiny/fp8 --max-tokens 32 --tag dsv4 (log §9)", readme="DeepSeek-V4 end to end (CPU)"),
    Row("correct.fast-real", "correctness", "llama fast arithmetic on real weights",
        "`hetero verify --arith fast` (tensor cores, bf16 cache, cuDNN): how close the cache and the answer are",
        LLAMA_GPU + BRIDGE_GPU, r_fast_real,
        command="bench/gpu/e2e_device.sh --backend cuda --no-bench --real-weights .weights --verify-args "
        "\"--arith fast --min-cosine 0.99 --max-ulp 65536\" (log §19.6–19.7)"),
    Row("correct.dsv4-gpu", "correctness", "DeepSeek-V4 from the GPU (pipeline, fast)",
        "`hetero verify --backend cuda --arith fast --weight-dtype checkpoint --gpus 0,0` on a 4-layer random "
        "model, four chat prompts", DSV4_GPU + BRIDGE_GPU, r_dsv4_gpu_verify,
        command="bench/gpu/dsv4_verify_device.sh, STAGES=pipeline (log §16.7)"),
    # speed
    Row("speed.dsv4-flash-h100", "speed", "DeepSeek-V4-Flash prefill, one H100",
        "8 layers at Flash's shapes in the checkpoint's precision (FP8 projections, FP4 experts, random weights), "
        "chunk 32,768, the default per-chunk expert path; whole-model tok/s extrapolated from those layers' "
        "per-ratio times to Flash's 43 (2 ratio-0, 21 ratio-4, 20 ratio-128)", DSV4_GPU,
        r_dsv4_flash("gpu_dsv4_phases-h100-fd74c60.jsonl"),
        command="BASE= GPU_TESTS=1 REV=fd74c60 T=8192,32768,131072 bash bench/gpu/dsv4_phases_device.sh, i.e. "
        "hetero_gpu_dsv4_layer_bench --weights checkpoint --layers 8 --t … --chunk 32768 --repeats 2 --warmup 1 "
        "--phases (log §50)", readme="DeepSeek-V4-Flash prefill, 8K / 32K / 128K"),
    Row("speed.dsv4-flash-h200", "speed", "DeepSeek-V4-Flash prefill, one H200 (older code)",
        "as speed.dsv4-flash-h100, on an H200, two invocations", DSV4_GPU,
        r_dsv4_flash("gpu_dsv4_phases-h200-af09ce0-c[56]-af09ce0.jsonl"),
        command="REV=af09ce0 BASE=out/prev T=8192,32768,131072 bash bench/gpu/dsv4_phases_device.sh (log §46)",
        status="older code: the newest H200 run"),
    Row("speed.dsv4-34-layers", "speed", "DeepSeek-V4, 34 Flash layers measured (older code)",
        "34 layers (the most one H200 holds in the checkpoint's precision), the pipeline bench, bridge off",
        DSV4_GPU + ["src/engine/cuda/dsv4_pipeline*", "bench/gpu/dsv4_pipeline_bench.cc"], r_pipeline34("speed"),
        command="hetero_gpu_dsv4_pipeline_bench --devices 0 --layers 34 --weights checkpoint --decoder-step 2048 "
        "--chunk 32768 --repeats 1 --bridge off,on --no-single (log §18.2)",
        status="superseded by speed.dsv4-flash-h100 (before the attention, indexer and expert rewrites of log §24–46)"),
    Row("speed.llama-1b-h100", "speed", "llama 1B forward, one H100",
        "Llama-3.2-1B shapes (random bf16 weights), fast arithmetic, bf16 cache, cuDNN attention, chunk 8,192",
        LLAMA_GPU, r_llama_forward("gpu_llama_forward-h100-fd74c60.jsonl"),
        command="hetero_gpu_llama_prefill_bench --tokens 8192,32768,131072 --modes off --kv bf16 --attention "
        "cudnn --repeat 5 (log §50)", readme="llama 1B forward, 8K / 32K / 128K"),
    Row("speed.llama-1b-h200", "speed", "llama 1B forward, one H200 (older code)", "as speed.llama-1b-h100, on an H200",
        LLAMA_GPU, r_llama_forward("llama-forward-attention-h200-3c94e4d.jsonl", "cuDNN"),
        command="hetero_gpu_llama_prefill_bench --tokens 8192,32768,131072 --kv bf16 --attention cudnn --modes off,on "
        "--repeat 3 (log §19.3)", status="older code: the newest H200 run"),
    Row("speed.cpu-prefill", "speed", "CPU prefill against the decoder's, same CPU",
        "SmolLM2-135M, the long chat prompt cut to each size; our engine with program and wire against mlx-lm's "
        "prefill, legs alternating (a ratio: CPU machine)", EXACT_CPU, r_cpu_prefill,
        command="hetero bench prefill-cpu --prompt-file prompts/chat/05-long-license.json --sizes 512,2048,4096 "
        "--refcheck --blas (log §4)"),
    # bridge cost
    Row("bridge.llama-served-1gpu", "bridge", "llama 1B, served bridge, program on the forward's GPU",
        "wall time with the tap, the exact program, framing and frame tags (\"tagged\", as served) against the "
        "forward alone (\"off\") in the same invocation", LLAMA_GPU + BRIDGE_GPU,
        r_llama_cost("gpu_llama_bridge_served-h100-0d966e5.jsonl", "tagged"),
        command="hetero_gpu_llama_prefill_bench --tokens 8192,32768 --modes off,on-engine,on,tagged --kv bf16 "
        "--attention cudnn --repeat 5 (log §50)", readme="bridge cost, llama 1B, one GPU (served)"),
    Row("bridge.dsv4-1gpu", "bridge", "DeepSeek-V4, program on the forward's GPU",
        "10 Flash layers (the most an H100 holds with the bridge at chunk 32,768), checkpoint precision; wall "
        "time to the manifest with the bridge on against off", DSV4_GPU + BRIDGE_GPU,
        r_dsv4_cost("gpu_bridge_cost_dsv4-h100-6fcb00c-same-gpu.jsonl"),
        command="OUT=… REV=6fcb00c GPU_TESTS=0 PLACEMENTS=-1 bash bench/gpu/bridge_cost_device.sh (log §47)",
        readme="bridge cost, DeepSeek-V4, one GPU"),
    Row("bridge.dsv4-1gpu-implied", "bridge", "DeepSeek-V4, one GPU, implied whole-model cost",
        "the 10-layer run split into the forward's slowdown and the tail after it; extrapolated", DSV4_GPU + BRIDGE_GPU,
        r_dsv4_implied_cost,
        command="hetero_gpu_dsv4_layer_bench --weights checkpoint --layers 10 --t 8192,32768 --chunk 32768 --repeats 2 "
        "--warmup 1 --bridge off,on-engine,on (log §49)"),
    Row("bridge.llama-2gpu", "bridge", "llama 1B, program on a second GPU",
        "`--program-device 1` on nvidia-h200-x2 (NVLink): bridge on against off", LLAMA_GPU + BRIDGE_GPU, r_two_gpu_llama,
        command="hetero_gpu_llama_prefill_bench --tokens 8192,32768,131072 --modes off,on --program-device 1 "
        "--rev 967639a (log §13.4)", readme="bridge cost, program on a second GPU",
        status="older code: no two-GPU machine lent since"),
    Row("bridge.dsv4-2gpu", "bridge", "DeepSeek-V4, program on a second GPU",
        "16 Flash layers, FP8 experts, `--program-device 1` on nvidia-h200-x2", DSV4_GPU + BRIDGE_GPU, r_two_gpu_dsv4,
        command="hetero_gpu_dsv4_layer_bench --t 8192,32768,131072 --layers 16 --bridge off,on --weights fp8 "
        "--repeats 2 --program-device 1 --rev 967639a (log §13.4)", status="older code: no two-GPU machine lent since"),
    Row("bridge.dsv4-34-layers", "bridge", "DeepSeek-V4, 34 layers, program on the same GPU (superseded)",
        "the README's old \"+9.4%\": 34 layers at the decoder's calls, a forward since ~3× faster", DSV4_GPU + BRIDGE_GPU,
        r_pipeline34("bridge"), command="as speed.dsv4-34-layers (log §18.2)",
        status="superseded by bridge.dsv4-1gpu (the same placement with today's forward)"),
    Row("bridge.host-wire", "bridge", "the host's work on one llama segment, as served",
        "`hetero_wire_bench --repeat 5`: one 8,192-token llama-1B segment (268 MB) framed into a reused buffer and "
        "tagged (wire version 2, pieces in parallel)", WIRE, r_wire_host,
        command="hetero_wire_bench --repeat 5 (log §49)"),
    # long context
    Row("long.llama-272k", "long", "llama, ~272K tokens through the decoder",
        "a 2-layer random llama (rope scaled to 1M positions) prefilled on the H200, decoded by mlx-lm on the GPU "
        "machine's CPU", LLAMA_GPU + BRIDGE_GPU + SERVED, r_memory_llama,
        command="bench/gpu/e2e_device.sh --backend cuda --no-bench --verify 0 --memory-sizes 348000 … (log §20.2)",
        readme="llama, 272K tokens from the H200"),
    Row("long.dsv4-1m-2m", "long", "DeepSeek-V4, 131K to 2M tokens through the decoder",
        "a 4-layer DeepSeek-V4 (YaRN ×16 / ×32) prefilled on the H200 (checkpoint FP8, fast), decoded by mlx-vlm "
        "on the GPU machine's CPU", DSV4_GPU + BRIDGE_GPU + SERVED, r_memory_dsv4,
        command="REV=c0843d7 LONG_SIZES=170000,680000 bash bench/gpu/dsv4_verify_device.sh; YARN=16|32 (log §23)",
        readme="DeepSeek-V4, 131K → 2M tokens from the H200"),
    Row("long.memory", "long", "peak memory of a bridge", "growth of each process's peak RSS over one bridged "
        "request, divided by the cache's size (SmolLM2-135M, CPU backend)", SERVED + EXACT_CPU, r_memory_front,
        command="python3 bench/memory.py --sizes 2048,7800 (log §20.1)"),
    Row("long.warm-tiny", "long", "a conversation bridged by its tails (CPU)", "20 turns, each new tail computed "
        "and sent only (tiny llama, context 65,536)", SERVED + EXACT_CPU + ["src/prefill/state_cache.*"],
        r_warm("warm-turns-tiny-llama-96e4634.jsonl", "a whole-prefix bridge: 49,834 rows"),
        command="python3 bench/warm_turns.py --model models/tiny-llama --context 65536 (log §22.1)",
        readme="a 20-turn conversation, tails only"),
    Row("long.warm-h200", "long", "a conversation bridged by its tails (H200, exact)", "16 turns; the CUDA exact "
        "engine's own state", SERVED + LLAMA_GPU, r_warm("warm-turns-h200-cuda-exact-16turns-*.jsonl", "H200, exact"),
        command="bench/gpu/e2e_device.sh --backend cuda --verify 0 --no-bench --warm-turns \"--turns 16 …\" (log §22.2)"),
    Row("long.warm-dsv4", "long", "DeepSeek-V4 conversation bridged by its tails (CPU)", "20 turns on the tiny "
        "DeepSeek-V4, each tail from the prefill host's checkpoints", SERVED + EXACT_CPU,
        r_warm("warm-turns-dsv4-tiny-native-*.jsonl", "tiny DeepSeek-V4, CPU"),
        command="python3 bench/warm_turns.py --model models/dsv4-tiny/native --prefill-model models/dsv4-tiny/fp8 "
        "--turns 20 (log §22.8)"),
    # served
    Row("served.ttft-cpu", "served", "time to first token, native against bridged (CPU)",
        "fresh random prompts through one front door, native forced against bridged, 32 greedy tokens; both "
        "legs on the same 2 cores", SERVED + EXACT_CPU, r_cold("cold-9b66cb8.jsonl"),
        command="hetero bench cold --sizes 256,1024,2048,4096 (log §5)", readme="first token, bridged against native (CPU)"),
    Row("served.ttft-gpu", "served", "time to first token, native against bridged (H200, exact)",
        "as served.ttft-cpu with the prefill on the H200 and the decoder on its CPU (random 135M)",
        SERVED + LLAMA_GPU + BRIDGE_GPU, r_cold("cold-gpu-h200-388aca9.jsonl", "388aca9"),
        command="bench/gpu/e2e_device.sh --backend cuda --sizes 512,1024 --verify 2 (log §12)"),
    Row("served.verdicts", "served", "verdicts against the decoder's own accounting",
        "a seeded mix (short, cold, warm, faulty prefill hosts, evicted mounts, streamed or not): each verdict's "
        "`reused` against the decoder's `cached_tokens`, and `/metrics`", SERVED, r_verdicts,
        command="PYTHONPATH=python .venv/bin/python bench/verdicts.py --model models/smollm2-135m-instruct; "
        "--seed 2 --n 100 (log §14.1)", readme="verdicts against the decoder's cached_tokens"),
    Row("served.at-once", "served", "eight cold bridges at once", "8 fresh ~3,450-token prompts bridged all at "
        "once against one after another (H200 exact prefill, decoder on its CPU)", SERVED, r_at_once,
        command="bench/gpu/e2e_device.sh --backend cuda … --concurrent \"--n 8 --words 3000 --max-tokens 32 --seed 7 "
        "--repeat 3\" (log §22.6)"),
    Row("served.short-behind-long", "served", "a short prompt behind a long one", "the prefill host's turns "
        "(`--turn-ms 5000`) against none", SERVED + EXACT_CPU, r_short_behind_long,
        command="cd bench && python3 short_behind_long.py --seed S (log §22.7)"),
    # tests
    Row("tests.ci", "tests", "`make test` on a fresh clone", "`CI=true bash .ci/run` in a fresh clone on the "
        "2-core CPU machine (Debian packages present; venv, models, build from scratch)", EVERYTHING, r_ci,
        command="d=$(mktemp -d) && git clone -q . $d/p && cd $d/p && CI=true bash .ci/run (log §8, §50)",
        readme="`make test`, fresh clone"),
    Row("tests.gpu-suite", "tests", "the GPU suite", "`build/hetero_gpu_tests` (GPU against the CPU reference)",
        ["tests/gpu", "src/engine/cuda", "src/kernels/cuda", "src/bridge/cuda"], r_gpu_suite,
        command="build/hetero_gpu_tests (log §50)", readme="GPU suite"),
    Row("tests.pytest-one-worker", "tests", "pytest, where the time goes", "`pytest -v --durations=0`, one worker",
        ["tests/py", "python"], r_pytest_time, command="PYTHONPATH=python .venv/bin/python -m pytest -v --durations=0 "
        "tests/py (log §15.5)", status="older code"),
]
