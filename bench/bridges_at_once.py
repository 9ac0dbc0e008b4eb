#!/usr/bin/env python3
"""hetero bench bridges-at-once: N cold bridges at once against the same N one after another.

(Not bench/concurrent.py: the decoder `hetero up` starts from bench/ would import that file for
the standard library's `concurrent` package.)

On one `hetero up` stack, the same N fresh prompts (--words each) three times, the decoder's
prompt cache cleared before each leg (through its seam, with the stack's secret):
  native:     one after another with X-PD-Bridge-Mode: native: the decoder's own answers;
  serial:     one after another, bridged (X-PD-Bridge-Mode: bridge);
  concurrent: all N at once, bridged, one client thread each.
Reported: each leg's wall time (first request sent to last answer), the concurrent/serial ratio,
every bridged verdict (complete and confirmed by the decoder's usage), and whether every answer
equals the decoder's own. Writes JSON lines to bench/results/bridges-at-once-<model>-<rev>.jsonl.

usage: python3 bench/bridges_at_once.py [--model DIR] [--n 8] [--words 2000] [--max-tokens 32]
                                         [--seed S] [--repeat R]
"""

import argparse
import json
import os
import platform
import random
import signal
import sys
import threading
import time
from pathlib import Path

from cold import ROOT, fresh_prompt, git_rev, post, provenance, start_stack


def ask(front: str, prompt: str, mode: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0}
    t0 = time.perf_counter()
    status, headers, reply = post(front + "/v1/chat/completions", body, {"X-PD-Bridge-Mode": mode})
    if status != 200:
        return {"status": status, "error": str(reply)[:300], "wall_s": time.perf_counter() - t0}
    v = json.loads(headers["X-PD-Bridge"])
    return {"status": status, "wall_s": time.perf_counter() - t0, "verdict": v["verdict"],
            "confirmed": v["confirmed"], "T": v["T"], "B": v["B"],
            "cached_tokens": reply["usage"]["prompt_tokens_details"]["cached_tokens"],
            "bridge_queue_ms": v["timings_ms"].get("bridge_queue"),
            "answer": reply["choices"][0]["message"]["content"]}


def leg(front: str, prompts: list, mode: str, max_tokens: int, at_once: bool) -> tuple:
    results = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = ask(front, prompts[i], mode, max_tokens)

    t0 = time.perf_counter()
    if at_once:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(prompts)):
            one(i)
    return time.perf_counter() - t0, results


def one_round(front: str, clear, prompts: list, max_tokens: int) -> tuple:
    """The three legs on these prompts: ({leg: {wall_s, results}}, ratio, all good)."""
    legs = {}
    for name, mode, at_once in (("native", "native", False), ("serial", "bridge", False),
                                ("concurrent", "bridge", True)):
        clear()
        wall, results = leg(front, prompts, mode, max_tokens, at_once)
        legs[name] = {"wall_s": wall, "results": results}
        print(f"{name}: {wall:.2f} s", flush=True)
    native = [r.get("answer") for r in legs["native"]["results"]]
    ok = True
    for name in ("serial", "concurrent"):
        for i, r in enumerate(legs[name]["results"]):
            r["answer_equal"] = r.get("answer") == native[i] and native[i] is not None
            good = (r.get("verdict") == "complete" and r.get("confirmed")
                    and r.get("cached_tokens") == r.get("B") and r["answer_equal"])
            ok &= bool(good)
            print(f"  {name} {i}: T={r.get('T')} {r.get('verdict') or r.get('error')} "
                  f"confirmed={r.get('confirmed')} answer={'=' if r['answer_equal'] else '!='} "
                  f"{r['wall_s']:.2f}s")
    ratio = legs["concurrent"]["wall_s"] / legs["serial"]["wall_s"]
    print(f"concurrent / serial wall: {legs['concurrent']['wall_s']:.2f} / "
          f"{legs['serial']['wall_s']:.2f} s = {ratio:.2f}x; native serial "
          f"{legs['native']['wall_s']:.2f} s; all complete, confirmed, equal: {ok}\n", flush=True)
    return legs, ratio, ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--words", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds on the same stack, round r with fresh prompts from seed + r")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()

    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"hetero-bridges-at-once-{os.getpid()}"
    proc, front, decoder, secret = start_stack(args.model, work)
    clear = lambda: post(decoder + "/hetero/clear", {}, {}, secret=secret)
    rounds = []
    try:
        for r in range(args.repeat):
            rng = random.Random(args.seed + r)
            prompts = [fresh_prompt(args.words, rng) for _ in range(args.n)]
            rounds.append((args.seed + r, *one_round(front, clear, prompts, args.max_tokens)))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)

    rev = git_rev()
    out = Path(args.out_dir) / f"bridges-at-once-{Path(args.model).name}-{rev}-seed{args.seed}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.node()} ({platform.machine()}, {platform.system()})"
    with out.open("w") as f:
        for seed, legs, ratio, ok in rounds:
            for name, data in legs.items():
                for i, r in enumerate(data["results"]):
                    row = {k: v for k, v in r.items() if k != "answer"}
                    f.write(json.dumps({"bench": "concurrent", "rev": rev, "machine": machine,
                                        "seed": seed, "leg": name, "i": i, **row}) + "\n")
                f.write(json.dumps({"bench": "concurrent", "rev": rev, "seed": seed, "leg": name,
                                    "n": args.n, "words": args.words,
                                    "wall_s": data["wall_s"]}) + "\n")
            f.write(json.dumps({"bench": "concurrent", "rev": rev, "seed": seed, "ratio": ratio,
                                "ok": ok, "n": len(rounds), **provenance()}) + "\n")
    ratios = [r[2] for r in rounds]
    print(f"concurrent / serial over {len(rounds)} rounds: "
          + ", ".join(f"{x:.2f}x" for x in ratios) + f"; all good: {all(r[3] for r in rounds)}")
    print(f"wrote {out}")
    return 0 if all(r[3] for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
