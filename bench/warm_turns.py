#!/usr/bin/env python3
"""hetero bench warm-turns: a growing conversation, each turn bridged by its tail only.

Runs one conversation of --turns turns (each adds a user message of --min-words..--max-words
words; the answers are the decoder's, greedy) twice, each time on a fresh `hetero up` stack:
  native:  every request with X-PD-Bridge-Mode: native (the decoder alone, its prompt cache
           warm from the turns before: what a user gets without hetero);
  bridged: every request through the front door's own routing: the first turn bridged whole,
           later turns by their tail (rows from what the decoder holds), the prefill host
           resuming from its prefix cache of its own state.
Per turn: T, the decoder's held prefix (the verdict's start), tokens the prefill host computed,
wire bytes, both wall times, the verdict, and whether the answer equals the native one (the
bridged conversation goes on with its own answers, so a difference shows from that turn on).

--context N runs on a copy of the model whose config says max_position_embeddings = N (the
weights are the model's own, linked): for a conversation longer than the model's context
window, which the front door would refuse; rope without scaling does not read the field.
--parallel runs the two passes side by side, each on its own stack (the decoder's native pass
is one core's work here for hours; the times then share the cores). Each turn is written to
<out>.progress as it ends (removed once the run writes its table), so a run cut short
still says how far it got.
--state DIR saves each pass after every turn (its rows, and the decoder's own cache rows for
the next turn's prompt: bench/checkpoint.py) and resumes from there when run again with the
same arguments; --stop-after N ends each pass after N turns; --no-bridged runs the native pass
alone (the longer one here), its table written by a later run with both. A conversation longer than the
machine's session so runs over several; a pass already finished is not run again.
Writes JSON lines to bench/results/warm-turns-<model>-<rev>.jsonl and prints a table.

usage: python3 bench/warm_turns.py [--model DIR] [--prefill-model DIR] [--turns 20]
                                   [--min-words 900] [--max-words 3500] [--context 65536]
                                   [--no-native | --no-bridged] [--parallel] [--state DIR]
                                   [--stop-after N]
(DeepSeek-V4: --model models/dsv4-tiny/native --prefill-model models/dsv4-tiny/fp8)
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

from typing import Optional

from checkpoint import Checkpoint
from cold import ROOT, WORDS, git_rev, post, provenance, start_stack


def with_context(model: Path, context: int, work: Path) -> Path:
    """A directory beside `work` that is `model` with max_position_embeddings = context."""
    out = work / f"{model.name}-ctx{context}"
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = context
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def user_turns(n: int, lo: int, hi: int, seed: int) -> list:
    rng = random.Random(seed)
    return [f"part {k + 1}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
            for k in range(n)]


PROGRESS_LOCK = threading.Lock()  # the two passes' threads append to one file


def run_conversation(model: Path, turns: list, mode: str, max_tokens: int,
                     prefill_model: str = "", progress: Path = None,
                     saved: Optional[Checkpoint] = None, stop_after: int = 0) -> list:
    """One pass; with `saved`, resumed from and saved to a checkpoint, and with stop_after,
    ended after that many turns (all of them when 0) to be resumed by a later run."""
    state = saved.load(turns) if saved else None
    rows, messages = (state["rows"], state["messages"]) if state else ([], [])
    resumed_at = len(rows) if state else -1
    if len(rows) == len(turns):  # a pass an earlier run finished
        return rows
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    work = tmp / f"hetero-bench-{os.getpid()}-{mode or 'bridged'}"  # one per pass
    proc, url, decoder_url, secret = start_stack(str(model), work=work,
                                                 prefill_model=prefill_model)
    rev = git_rev()

    def request(k: int) -> dict:  # turn k's request (its messages a copy: the list grows)
        return {"model": "default_model", "messages": messages[: 2 * k] + [
            {"role": "user", "content": turns[k]}], "max_tokens": max_tokens, "temperature": 0.0}

    try:
        if state:
            saved.restore((decoder_url, secret), work / "store", state)
            print(f"  {mode or 'bridged'}: resumed after turn {len(rows)} with the decoder's "
                  f"own {state['B']} rows", flush=True)
        for k in range(len(rows), min(stop_after or len(turns), len(turns))):
            body = request(k)
            messages.append(body["messages"][-1])
            headers = {"X-PD-Bridge-Mode": mode} if mode else {}
            t0 = time.perf_counter()
            status, reply_headers, reply = post(url + "/v1/chat/completions", body, headers)
            wall = time.perf_counter() - t0
            if status != 200:
                raise SystemExit(f"turn {k + 1}: HTTP {status}: {str(reply)[:400]}")
            text = reply["choices"][0]["message"]["content"]
            v = json.loads(reply_headers["X-PD-Bridge"])
            rows.append({"turn": k + 1, "T": v["T"], "verdict": v["verdict"], "route": v.get("route"),
                         "confirmed": v["confirmed"], "start": v.get("start", 0),
                         "computed": v.get("computed"), "bytes": v["bytes"], "wall_s": wall,
                         "cached_tokens": reply["usage"]["prompt_tokens_details"]["cached_tokens"],
                         "answer": text, "rev": rev, "resumed": k == resumed_at})
            print(f"  {mode or 'bridged'} turn {k + 1}: T={v['T']} {v['verdict']} "
                  f"start={rows[-1]['start']} computed={rows[-1]['computed']} "
                  f"bytes={v['bytes']} {wall:.2f}s", flush=True)
            if progress:
                with PROGRESS_LOCK, progress.open("a") as f:
                    f.write(json.dumps({"pass": mode or "bridged", **rows[-1]}) + "\n")
            messages.append({"role": "assistant", "content": text})
            if saved:
                saved.save((decoder_url, secret), turns, rows, messages, body,
                           request(k + 1) if k + 1 < len(turns) else None)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--prefill-model", default="", help="the prefill host's checkpoint")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--min-words", type=int, default=900)
    p.add_argument("--max-words", type=int, default=3500)
    p.add_argument("--context", type=int, default=0, help="raise max_position_embeddings")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--parallel", action="store_true",
                   help="both passes at once, each on its own stack")
    p.add_argument("--state", default="",
                   help="save each pass after every turn in this directory, and resume from it "
                        "(a run longer than the machine's session; llama family)")
    p.add_argument("--stop-after", type=int, default=0,
                   help="end each pass after this many turns (to resume with --state)")
    p.add_argument("--no-bridged", action="store_true",
                   help="the native pass only, saved with --state (its table comes with a later "
                        "run that has the bridged pass)")
    p.add_argument("--no-native", action="store_true",
                   help="the bridged pass only (where the decoder is too slow for both); "
                        "answers are then not compared")
    args = p.parse_args()
    # A run started in the background ignores SIGINT, so SIGTERM (kill <pid>) stops it the same
    # way: the pass in progress ends, its servers are stopped, and the last saved turn stays.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    model = Path(args.model).resolve()
    if args.context:
        model = with_context(model, args.context, ROOT / "out" / "bench-models")
    turns = user_turns(args.turns, args.min_words, args.max_words, args.seed)
    print(f"warm turns on {model.name}: {args.turns} turns of {args.min_words}-{args.max_words} "
          "words", flush=True)
    rev = git_rev()
    name = "-".join(Path(args.model).resolve().parts[-2:]) if args.prefill_model else model.name
    out = Path(args.out_dir) / f"warm-turns-{name}-{rev}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    progress = out.with_name(out.name + ".progress")
    state = Path(args.state) if args.state else None
    if state is None:
        progress.unlink(missing_ok=True)

    if args.no_bridged and (args.no_native or not args.state):
        raise SystemExit("--no-bridged runs the native pass alone, to be saved: it needs --state "
                         "and the native pass")
    passes = {"": None} if args.no_native else {"": None, "native": None}
    if args.no_bridged:
        passes.pop("")
    failed = []

    def one_pass(mode: str) -> None:
        try:
            saved = Checkpoint(state, mode or "bridged") if state else None
            passes[mode] = run_conversation(model, turns, mode, args.max_tokens,
                                            args.prefill_model, progress, saved, args.stop_after)
        except BaseException as e:  # a pass that failed ends the run, saying which and why
            failed.append(f"{mode or 'bridged'} pass: {e!r}")

    if args.parallel:
        threads = [threading.Thread(target=one_pass, args=(m,)) for m in passes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for m in passes:
            if not failed:
                one_pass(m)
    if failed:
        raise SystemExit("; ".join(failed) + f" (turns so far: {progress})")
    short = {m or "bridged": len(r) for m, r in passes.items() if len(r) < args.turns}
    if short or args.no_bridged:  # --stop-after, --no-bridged: the table waits for every turn
        done = {m or "bridged": len(r) for m, r in passes.items()}
        print(f"turns so far {done} of {args.turns}, saved in {state}: run again "
              f"{'with the bridged pass ' if args.no_bridged else ''}to go on")
        return 0
    bridged = passes[""]
    native = passes.get("native") or [None] * len(bridged)
    machine = f"{platform.node()} ({platform.machine()}, {platform.system()})"
    prov = {k: v for k, v in provenance().items() if k not in ("rev", "machine")}
    print("\n| turn | T | decoder held | computed | wire bytes | verdict | bridged s | "
          "native s | answer = native |")
    print("|---:|---:|---:|---:|---:|---|---:|---:|:---:|")
    ok = True
    with out.open("w") as f:
        for b, n in zip(bridged, native):
            # Without the native pass: no answer to compare, only the decoder's confirmation.
            same = None if n is None else b["answer"] == n["answer"] and b["T"] == n["T"]
            ok &= same is not False and b["confirmed"]
            row = {"bench": "warm_turns", "rev": rev, "machine": machine, "model": model.name,
                   "turn": b["turn"], "T": b["T"], "bridged": {k: v for k, v in b.items()
                                                              if k != "answer"},
                   "native": n and {k: v for k, v in n.items() if k != "answer"},
                   "answer_equal": same, "passes_side_by_side": args.parallel, **prov}
            f.write(json.dumps(row) + "\n")
            native_s = "—" if n is None else f"{n['wall_s']:.2f}"
            equal = "—" if same is None else "yes" if same else "NO"
            print(f"| {b['turn']} | {b['T']:,} | {b['start']:,} | {b['computed']} | "
                  f"{b['bytes']:,} | {b['verdict']}{' (resumed)' if b.get('resumed') else ''} | {b['wall_s']:.2f} | {native_s} | {equal} |")
    progress.unlink(missing_ok=True)
    print(f"\nwrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
