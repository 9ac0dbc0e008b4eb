#!/usr/bin/env python3
"""hetero bench short-behind-long: a short cold prompt sent while a long one is prefilling.

The prefill host computes one prefill at a time. With `--turn-ms` (its default, 5000) a prefill
that has held the engine that long while another request waits gives it up at its next chunk,
keeps its state in the prefix cache, and resumes after; with `--turn-ms 0` the short prompt
waits for the whole long prefill. Two `hetero up` stacks, one per setting (HETERO_PREFILL_TURN_MS);
on each, the long prompt is sent, then after --delay seconds the short one. Reported per leg:
each request's wall time to its answer, its verdict (complete, confirmed by the decoder's
usage) and its wait at the prefill host; and whether each answer is the same in both legs
(the long prompt's rows were computed in several turns in one leg and in one in the other).
Writes JSON lines to bench/results/short-behind-long-<model>-<rev>.jsonl.

usage: python3 bench/short_behind_long.py [--model DIR] [--long-words 3000] [--short-words 200]
                                          [--delay 2] [--turn-ms 5000] [--max-tokens 16]
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

from bridges_at_once import ask
from cold import ROOT, fresh_prompt, git_rev, provenance, start_stack


def one_leg(model: str, turn_ms: int, long_prompt: str, short_prompt: str, delay: float,
            max_tokens: int) -> dict:
    os.environ["HETERO_PREFILL_TURN_MS"] = str(turn_ms)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"hetero-sbl-{os.getpid()}-{turn_ms}"
    proc, front, *_ = start_stack(model, work)
    out = {}
    try:
        ask(front, fresh_prompt(20, random.Random(turn_ms)), "bridge", 2)  # warm
        t = threading.Thread(target=lambda: out.update(long=ask(front, long_prompt, "bridge",
                                                                 max_tokens)))
        t.start()
        time.sleep(delay)
        out["short"] = ask(front, short_prompt, "bridge", max_tokens)
        t.join()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--long-words", type=int, default=3000)
    p.add_argument("--short-words", type=int, default=200)
    p.add_argument("--delay", type=float, default=2.0)
    p.add_argument("--turn-ms", type=int, default=5000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = p.parse_args()
    rng = random.Random(a.seed)
    long_prompt, short_prompt = fresh_prompt(a.long_words, rng), fresh_prompt(a.short_words, rng)
    legs = {}
    for turn_ms in (0, a.turn_ms):
        legs[turn_ms] = one_leg(a.model, turn_ms, long_prompt, short_prompt, a.delay,
                                a.max_tokens)
        for which in ("long", "short"):
            r = legs[turn_ms][which]
            print(f"turn-ms {turn_ms:>5} {which:>5}: T={r.get('T')} {r.get('verdict')} "
                  f"confirmed={r.get('confirmed')} {r['wall_s']:.2f} s (waited "
                  f"{(r.get('bridge_queue_ms') or 0) / 1000:.2f} s at the prefill host)",
                  flush=True)
    ok = True
    for which in ("long", "short"):
        rs = [legs[t][which] for t in legs]
        same = rs[0].get("answer") is not None and rs[0].get("answer") == rs[1].get("answer")
        good = all(r.get("verdict") == "complete" and r.get("confirmed") and
                   r.get("cached_tokens") == r.get("B") for r in rs)
        ok &= same and good
        print(f"{which}: answers the same in both legs: {same}; all complete and confirmed: {good}")
    gain = legs[0]["short"]["wall_s"] / legs[a.turn_ms]["short"]["wall_s"]
    print(f"the short prompt's answer: {legs[0]['short']['wall_s']:.2f} s without turns, "
          f"{legs[a.turn_ms]['short']['wall_s']:.2f} s with --turn-ms {a.turn_ms} ({gain:.1f}x)")
    rev = git_rev()
    out = Path(a.out_dir) / f"short-behind-long-{Path(a.model).name}-{rev}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for turn_ms, leg in legs.items():
            for which, r in leg.items():
                row = {k: v for k, v in r.items() if k != "answer"}
                f.write(json.dumps({"bench": "short_behind_long", "rev": rev,
                                    "machine": f"{platform.node()} ({platform.machine()})",
                                    "seed": a.seed, "turn_ms": turn_ms, "request": which,
                                    "delay_s": a.delay, **row}) + "\n")
        f.write(json.dumps({"bench": "short_behind_long", "rev": rev, "ok": ok,
                            "short_gain": gain, "n": 1, **provenance()}) + "\n")
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
