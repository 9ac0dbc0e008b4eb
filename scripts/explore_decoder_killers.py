#!/usr/bin/env python3
"""Which completion bodies kill the decoder's generation thread (or its process)?

Starts `python -m hetero_mlx serve` (no secret) on a tiny model, sends one hostile-but-JSON body
at a time to the decoder's completion paths, and after each asks whether the generation thread
still lives (mlx-lm's GET /health says "unavailable" once ResponseGenerator.generation_available()
is False; for mlx-vlm, a short normal request must still be answered). A dead decoder is
restarted before the next body. Prints one line per body and a JSON summary at the end.

  PYTHONPATH=python .venv/bin/python scripts/explore_decoder_killers.py \
      --model models/tiny-llama [--seam-path /tmp/orig/python] [--only stop]

--seam-path runs another copy of the hetero_mlx package (e.g. the committed one, to reproduce
against the plain seam); the decoder packages are the venv's, unmodified. Findings:
docs/design/decoder-seam.md, "Bounds and liveness".
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
BIG = 2**70
MSG = [{"role": "user", "content": "Say hello."}]


def cases(vocab: int, chat_only: bool):
    """(name, path, body): every field mlx-lm's do_POST / handle_completion / the generation
    thread reads, with values of the right JSON kind where mlx-lm checks only the kind."""
    chat = "/v1/chat/completions"
    text = "/v1/completions"
    base_c = {"messages": MSG, "max_tokens": 4}
    base_t = {"prompt": "Say hello.", "max_tokens": 4}
    out = []

    def add(name, body, path=chat):
        if chat_only and path != chat:
            return
        out.append((name, path, body))

    for v in (5, [1], [["x"]], [{}], [None], True, {"a": 1}, [""], ["x" * 20000], ["\u0000"]):
        add(f"stop={json.dumps(v)[:30]}", dict(base_c, stop=v))
        add(f"text stop={json.dumps(v)[:30]}", dict(base_t, stop=v), text)
    for name, lb in [
        ("huge key", {str(BIG): 1.0}), ("negative key", {"-1": 5.0}),
        ("out of vocab key", {str(vocab + 1000): 5.0}), ("far out of vocab key", {str(2**40): 1.0}),
        ("nan value", {"1": float("nan")}), ("inf value", {"1": float("inf")}),
        ("-inf value", {"1": float("-inf")}), ("null value", {"1": None}),
        ("string value", {"1": "x"}), ("list value", {"1": [1]}), ("float key", {"1.5": 1.0}),
        ("empty", {}), ("many keys", {str(i): 1.0 for i in range(5000)}),
    ]:
        add(f"logit_bias {name}", dict(base_c, logit_bias=lb))
    for field, values in [
        ("top_k", [vocab, vocab + 1, 10**9, BIG]),
        ("seed", [BIG, -1, 2**63, 2**64]),
        ("top_logprobs", [11, 0, -1]),
        ("max_tokens", [2**31, 2**62, BIG, True]),
        ("max_completion_tokens", [BIG]),
        ("num_draft_tokens", [10**9, BIG]),
        ("repetition_context_size", [0, 10**9, BIG]),
        ("presence_context_size", [0, BIG]),
        ("frequency_context_size", [0, BIG]),
        ("repetition_penalty", [float("inf"), float("nan"), 1e308, 2.0]),
        ("presence_penalty", [float("inf"), float("-inf"), float("nan")]),
        ("frequency_penalty", [float("inf"), float("-inf"), float("nan")]),
        ("temperature", [float("inf"), float("nan"), 1e-30, 1e308]),
        ("top_p", [float("nan"), 1e-30]),
        ("min_p", [float("nan"), 1.0]),
        ("xtc_probability", [float("nan"), 1.0]),
        ("xtc_threshold", [float("nan"), 0.0]),
        ("logprobs", [True]),
    ]:
        for v in values:
            body = dict(base_c, **{field: v})
            if field in ("temperature", "top_p", "min_p", "xtc_probability", "xtc_threshold"):
                body.setdefault("temperature", 1.0)
            add(f"{field}={v!r}"[:40], body)
    for v in ([], "x", 5, {"a": [1]}, {"tokenize": False}, {"return_dict": True},
              {"return_tensors": "np"}, {"add_generation_prompt": False},
              {"continue_final_message": True}, {"tools": 5}, {"padding": "max_length"},
              {"truncation": True, "max_length": 1}, {"enable_thinking": [1]}):
        add(f"chat_template_kwargs={json.dumps(v)[:30]}", dict(base_c, chat_template_kwargs=v))
    for name, messages in [
        ("content int", [{"role": "user", "content": 5}]),
        ("content dict", [{"role": "user", "content": {"a": 1}}]),
        ("content list of str", [{"role": "user", "content": ["x"]}]),
        ("content part no type", [{"role": "user", "content": [{"text": "x"}]}]),
        ("content part int text", [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        ("content null", [{"role": "user", "content": None}]),
        ("content empty", [{"role": "user", "content": ""}]),
        ("image part", [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]),
        ("image part int url", [{"role": "user", "content": [
            {"type": "image_url", "image_url": 5}]}]),
        ("role int", [{"role": 5, "content": "x"}]),
        ("role missing", [{"content": "x"}]),
        ("role tool", [{"role": "tool", "content": "x"}]),
        ("role assistant last", [{"role": "assistant", "content": "x"}]),
        ("system only", [{"role": "system", "content": "x"}]),
        ("message str", ["x"]),
        ("message null", [None]),
        ("messages dict", {"role": "user", "content": "x"}),
        ("messages empty", []),
        ("messages str", "x"),
        ("tool_calls odd", [{"role": "assistant", "content": "",
                             "tool_calls": [{"function": {"arguments": "{bad"}}]},
                            {"role": "user", "content": "x"}]),
        ("tool_calls int", [{"role": "assistant", "content": "", "tool_calls": 5},
                            {"role": "user", "content": "x"}]),
    ]:
        add(f"messages {name}", dict(base_c, messages=messages))
    for v in (5, "x", [5], [{}], [{"type": "function"}], [{"type": "function", "function": 5}],
              {"a": 1}):
        add(f"tools={json.dumps(v)[:30]}", dict(base_c, tools=v))
    for v in (5, "x", [1], {"user": 5}, {"stop": 5}, {"assistant": None}):
        add(f"role_mapping={json.dumps(v)[:30]}", dict(base_c, role_mapping=v))
    for v in ("", [1, 2], 5, None, {"a": 1}, "\u0000"):
        add(f"prompt={json.dumps(v)[:30]}", dict(base_t, prompt=v), text)
    for v in (5, {"include_usage": 5}, {}, "x"):
        add(f"stream_options={json.dumps(v)[:30]}", dict(base_c, stream=True, stream_options=v))
    return out


class Decoder:
    def __init__(self, args):
        self.args = args
        self.proc = None
        self.log = Path(args.log)

    def start(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=self.args.seam_path)
        cmd = [sys.executable, "-m", "hetero_mlx", "serve", "--model", self.args.model,
               "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.log, "a"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.alive() == "ok":
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"decoder exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.3)
        raise SystemExit("decoder did not start")

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def alive(self) -> str:
        """"ok", "generation dead" or "process dead"."""
        if self.proc.poll() is not None:
            return "process dead"
        if self.args.vlm:
            try:
                r = requests.post(self.url("/v1/chat/completions"), timeout=60,
                                  json={"model": self.args.model, "messages": MSG,
                                        "max_tokens": 2})
                return "ok" if r.status_code == 200 else f"generation dead ({r.status_code})"
            except requests.RequestException:
                return "process dead" if self.proc.poll() is not None else "no answer"
        try:
            r = requests.get(self.url("/health"), timeout=10)
            return "ok" if r.json().get("status") == "ok" else "generation dead"
        except requests.RequestException:
            return "process dead" if self.proc.poll() is not None else "no answer"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--seam-path", default=str(REPO / "python"))
    parser.add_argument("--vlm", action="store_true", help="mlx-vlm decoder: chat path only")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--log", default="/tmp/explore_decoder.log")
    parser.add_argument("--timeout", type=float, default=30, help="seconds per request")
    args = parser.parse_args()
    decoder = Decoder(args)
    decoder.start()
    results = []
    try:
        for name, path, body in cases(args.vocab, args.vlm):
            if args.only and args.only not in name:
                continue
            if args.vlm:
                body = dict(body, model=args.model)
            try:
                r = requests.post(decoder.url(path), data=json.dumps(body), timeout=args.timeout,
                                  headers={"Content-Type": "application/json"})
                status = r.status_code
                reply = r.text[:120].replace("\n", " ")
            except requests.RequestException as e:
                status, reply = None, type(e).__name__
            time.sleep(0.3)
            state = decoder.alive()
            if reply == "ReadTimeout" and state == "ok":
                # Still generating for nobody (max_tokens huge): not a killer, but restart so
                # that it does not slow every later case.
                state = "ok (timed out)"
                decoder.stop()
                decoder.start()
            results.append({"case": name, "path": path, "status": status, "state": state,
                            "reply": reply})
            print(f"{state:16} {status!s:5} {name:45} {reply}", flush=True)
            if not state.startswith("ok"):
                decoder.stop()
                decoder.start()
    finally:
        decoder.stop()
    killers = [r for r in results if not r["state"].startswith("ok")]
    print(json.dumps({"cases": len(results), "killers": killers}, indent=1))


if __name__ == "__main__":
    main()
