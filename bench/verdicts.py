#!/usr/bin/env python3
"""Do the front door's verdicts agree with the decoder? A mixed run of requests on real
processes, each verdict checked against the decoder's own usage.

The stack (tests/py/frontstack.py): the MLX decoder with its seam (--test-faults), one healthy
prefill host and one per injected fault, a front door on each. The requests (seeded): short
prompts, cold long ones, warm repeats, long ones through faulty prefill hosts (corrupt, truncated,
gap, killed, down), and cold long ones whose mount the seam evicts right before the decoder's
lookup (pin kept: it must come back; pin dropped: the decoder re-prefills). Half stream (with
stream_options.include_usage: the confirmed verdict arrives in the usage event), half do not (the
header is the confirmed verdict).

For every request, agreement with the decoder means:
  - the verdict is confirmed and its `reused` equals the decoder's usage cached_tokens;
  - a bridged verdict (complete, partial B/T) has cached_tokens == B; any other has B == 0;
and, per front door, the /metrics counts by verdict moved exactly as the confirmed verdicts.
Each scenario's expected verdict is checked too (reported apart: that is behaviour, not
agreement). Writes bench/results/verdicts-<rev>.jsonl and prints a table.

usage: .venv/bin/python bench/verdicts.py [--n 50] [--seed 1] [--model models/tiny-llama]
"""

import argparse
import collections
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "py"))

from frontstack import (Stack, answer, chat, free_port, metrics,  # noqa: E402
                        requests, text, verdict_of)

KINDS = ("complete", "partial", "skipped", "declined", "unconfirmed")
# scenario -> (front door, fault armed on the seam, expected verdict prefix)
SCENARIOS = {
    "short": ("healthy", None, "skipped: short"),
    "cold": ("healthy", None, "complete"),
    "warm": ("healthy", None, "skipped: warm"),
    "evicted-pinned": ("healthy", "evict", "complete"),
    "evicted-lost": ("healthy", "drop-mount", "declined: the decoder re-prefilled"),
    "corrupt": ("corrupt:1", None, "partial"),
    "truncated": ("truncate-after:2", None, "partial"),
    "gap": ("gap:1", None, "partial"),
    "killed": ("exit-after:1", None, "partial"),
    "down": ("down", None, "declined"),
}
MIX = (["short"] * 8 + ["cold"] * 10 + ["warm"] * 6 + ["evicted-pinned"] * 5 +
       ["evicted-lost"] * 5 + ["corrupt"] * 4 + ["truncated"] * 4 + ["gap"] * 4 +
       ["killed"] * 2 + ["down"] * 2)


def git_rev() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                       text=True)
    return r.stdout.strip() or "unknown"


def send(front, body: dict, streamed: bool) -> dict:
    """One request through a front door: the header verdict, the confirmed verdict, the
    decoder's own cached_tokens and the answer."""
    url = Stack.url(front.port, "/v1/chat/completions")
    if not streamed:
        r = requests.post(url, json=body, timeout=600)
        reply = r.json()
        usage = reply.get("usage") or {}
        v = verdict_of(r.headers)
        return {"status": r.status_code, "header": v, "confirmed": v,
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                "answer": answer(reply) if r.status_code == 200 else None}
    body = dict(body, stream=True, stream_options={"include_usage": True})
    r = requests.post(url, json=body, stream=True, timeout=600)
    header, confirmed, cached, parts = verdict_of(r.headers), None, None, []
    for line in r.content.decode().split("\n"):
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if event.get("choices"):
            parts.append(event["choices"][0].get("delta", {}).get("content") or "")
        elif isinstance(event.get("usage"), dict):
            confirmed = event.get("x_pd_bridge")
            cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"status": r.status_code, "header": header, "confirmed": confirmed,
            "cached_tokens": cached, "answer": "".join(parts)}


def agreement(res: dict) -> list:
    """What in this result disagrees with the decoder's own accounting ([] when nothing)."""
    v, c = res["confirmed"], res["cached_tokens"]
    if v is None:
        return ["no confirmed verdict"]
    if c is None:
        return ["the decoder reported no cached_tokens"]
    bad = []
    if not v.get("confirmed"):
        bad.append("verdict not confirmed")
    if v.get("reused") != c:
        bad.append(f"reused {v.get('reused')} != decoder cached_tokens {c}")
    kind = v["verdict"].split(" ")[0].rstrip(":")
    if kind in ("complete", "partial") and c != v["B"]:
        bad.append(f"bridged B={v['B']} but the decoder reused {c}")
    if kind not in ("complete", "partial") and v["B"] != 0:
        bad.append(f"{kind} with B={v['B']}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=len(MIX))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    ap.add_argument("--out", default="", help="results file (default: bench/results/...)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    plan = [MIX[i % len(MIX)] for i in range(a.n)]
    rng.shuffle(plan)
    rev = git_rev()
    tmp = Path(tempfile.mkdtemp(prefix="hetero-verdicts-"))
    stack = Stack(Path(a.model), tmp)
    rows, t0 = [], time.monotonic()
    try:
        opts = {"bridge-min-tokens": 64, "bridge-min-tail": 64, "partial-min-fraction": 0.05,
                "stall-ms": 5000}
        fronts = {}
        for name in sorted({s[0] for s in SCENARIOS.values()}):
            if name == "down":
                fronts[name] = stack.front(free_port(), **opts)
            else:
                fault = "" if name == "healthy" else name
                # 64-token segments: a salvaged prefix is longer than the chat template's
                # system prompt, which the decoder already holds from earlier requests.
                fronts[name] = stack.front(stack.prefill(fault, chunk=64).port, **opts)
        before = {name: metrics(f) for name, f in fronts.items()}
        seen = []  # bodies already answered: a warm request repeats one
        for i, scenario in enumerate(plan):
            front_name, fault, expect = SCENARIOS[scenario]
            if scenario == "short":
                body = chat(f"Say a colour, number {i}.", max_tokens=8)
            elif scenario == "warm" and seen:
                body = seen[-1]  # the last cold prompt: still in the decoder's LRU cache
            else:
                body = chat(text(f"verdicts-{a.seed}-{i}", 110), max_tokens=8)
                if scenario == "warm":
                    expect = "complete"  # an eviction fault since emptied the decoder's cache
            if fault:
                seen.clear()  # the seam's test eviction drops every cached entry
                r = requests.post(Stack.url(stack.decoder.port, "/hetero/fault"),
                                  json={"kind": fault}, timeout=10)
                assert r.status_code == 200, r.text
            streamed = i % 2 == 1
            res = send(fronts[front_name], body, streamed)
            if scenario == "cold":
                seen.append(body)
            bad = agreement(res)
            got = (res["confirmed"] or {}).get("verdict", "")
            # A broken stream is salvaged (partial) when enough of it verified and the decoder
            # does not hold as much itself, else declined; a killed host stays down afterwards.
            ok = got.startswith(expect) or (expect in ("partial", "declined") and
                                            got.startswith(("partial", "declined")))
            rows.append({"i": i, "scenario": scenario, "front": front_name, "stream": streamed,
                         "status": res["status"], "header": res["header"]["verdict"],
                         "header_confirmed": res["header"].get("confirmed"),
                         "verdict": got, "B": (res["confirmed"] or {}).get("B"),
                         "T": (res["confirmed"] or {}).get("T"),
                         "reused": (res["confirmed"] or {}).get("reused"),
                         "decoder_cached_tokens": res["cached_tokens"],
                         "agrees": not bad, "disagreements": bad, "expected": expect,
                         "as_expected": ok})
            print(f"{i:3d} {scenario:15s} {'stream' if streamed else 'plain ':6s} "
                  f"{'ok ' if not bad else 'BAD'} cached={res['cached_tokens']} {got}", flush=True)
        # /metrics moved exactly as the confirmed verdicts did, per front door.
        metric_rows = []
        for name, f in fronts.items():
            after = metrics(f)
            counted = collections.Counter(r["verdict"].split(" ")[0].rstrip(":")
                                          for r in rows if r["front"] == name)
            for k in KINDS:
                key = f'hetero_requests_total{{verdict="{k}"}}'
                moved = after.get(key, 0) - before[name].get(key, 0)
                metric_rows.append({"front": name, "kind": k, "metrics": moved,
                                    "verdicts": counted.get(k, 0),
                                    "agrees": moved == counted.get(k, 0)})
    finally:
        stack.stop()
    mismatches = sum(not r["agrees"] for r in rows)
    metric_mismatches = sum(not m["agrees"] for m in metric_rows)
    corrected = sum(r["stream"] and r["header"] != r["verdict"] for r in rows)
    summary = {"bench": "verdicts", "rev": rev, "model": a.model, "seed": a.seed,
               "requests": len(rows), "streamed": sum(r["stream"] for r in rows),
               "mismatches": mismatches, "metric_mismatches": metric_mismatches,
               "unexpected": sum(not r["as_expected"] for r in rows),
               "stream_predictions_corrected": corrected,
               "by_verdict": dict(collections.Counter(r["verdict"].split(" ")[0].rstrip(":")
                                                      for r in rows)),
               "wall_s": round(time.monotonic() - t0, 1), "n": 1}
    from cold import provenance  # the machine, GPU, arithmetic and command (issue 53)
    summary.update({k: v for k, v in provenance().items() if k != "rev"})
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"verdicts-{rev}.jsonl"
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(dict(r, bench="verdicts", rev=rev)) + "\n")
        for m in metric_rows:
            f.write(json.dumps(dict(m, bench="verdicts-metrics", rev=rev)) + "\n")
        f.write(json.dumps(summary) + "\n")
    print("\n| scenario | n | verdicts | agree with the decoder |\n|---|---:|---|---:|")
    for s in SCENARIOS:
        mine = [r for r in rows if r["scenario"] == s]
        if mine:
            kinds = collections.Counter(r["verdict"].split(":")[0].split(" ")[0] for r in mine)
            print(f"| {s} | {len(mine)} | {dict(kinds)} | {sum(r['agrees'] for r in mine)}"
                  f"/{len(mine)} |")
    print("\n" + json.dumps(summary))
    print(f"written: {out}")
    return 0 if mismatches == 0 and metric_mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
