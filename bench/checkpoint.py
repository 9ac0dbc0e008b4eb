"""A conversation pass saved after each turn, so that a run longer than the machine's session
resumes where it stopped (bench/warm_turns.py --state).

What a pass needs to go on is its rows and messages so far and the decoder's prompt cache. The
decoder's cache is saved as the decoder's own bytes: after turn k, the seam dumps the rows the
decoder would reuse for turn k + 1's prompt (POST /hetero/cache, the rows `hetero verify`
compares against), and a resumed stack mounts exactly those rows for exactly those ids (POST
/hetero/mount). The decoder then finds the same prefix, of the same length, holding the same
bits as if it had run on, and computes the rest itself. The prefill host's own prefix cache is
not saved: a resumed bridged pass's next tail is computed from position 0 (its verdict's
"computed" says so).

Llama-family decoders only (the seam dumps and mounts DeepSeek-V4's cache differently).
Files, in <state>/<pass>/: state.json (rows, messages, the prefix's ids, the decoder's
fingerprint) and cache-<turn>.safetensors, each written whole before the last is removed.
"""

import json
import os
import shutil
import sys
import time
import urllib.request
from pathlib import Path
from typing import List, Optional, Tuple

from cold import ROOT, post, seam_auth

sys.path.insert(0, str(ROOT / "python"))
from hetero_mlx import STORE_FORMAT  # noqa: E402  (the package's __init__ imports nothing)


def _seam(url: str, secret: str, path: str, body: Optional[dict] = None) -> dict:
    if body is None:
        req = urllib.request.Request(url + path, headers=seam_auth(secret, "GET", url + path))
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())
    status, _, reply = post(url + path, body, {}, secret=secret)
    if status != 200:
        raise RuntimeError(f"seam {path}: HTTP {status}: {str(reply)[:400]}")
    return reply


def _cached(url: str, secret: str, ids: List[int]) -> int:
    return _seam(url, secret, "/hetero/cached_prefix", {"ids": ids})["cached_tokens"]


def _ids(url: str, secret: str, body: dict) -> List[int]:
    return _seam(url, secret, "/hetero/tokenize", body)["ids"]


class Checkpoint:
    def __init__(self, root: Path, name: str):
        self.dir = root / name
        self.file = self.dir / "state.json"

    def load(self, turns: List[str]) -> Optional[dict]:
        """The saved state of a pass of this conversation (its user turns), if any."""
        if not self.file.exists():
            return None
        state = json.loads(self.file.read_text())
        if state["turns"] != turns:
            raise RuntimeError(f"{self.file} is another conversation's (its turns differ): "
                               "give another --state directory")
        return state

    def save(self, decoder: Tuple[str, str], turns: List[str], rows: list, messages: list,
             body: dict, next_body: Optional[dict]) -> None:
        """After a turn (body: its request): rows and messages, and the decoder's rows for the
        part of next_body's prompt it would reuse (none after the last turn)."""
        url, secret = decoder
        self.dir.mkdir(parents=True, exist_ok=True)
        state = {"turns": turns, "rows": rows, "messages": messages, "B": 0, "ids": []}
        if next_body is not None:
            # mlx-lm stores prompt + answer after the reply has gone out: wait for that insert
            # (an entry as long as the prompt), then ask what the next prompt would reuse.
            ids, deadline = _ids(url, secret, body), time.monotonic() + 120
            while max(_cached(url, secret, ids + [0]), _cached(url, secret, ids + [1])) < len(ids):
                if time.monotonic() > deadline:
                    raise RuntimeError("the decoder never cached the turn's prompt")
                time.sleep(0.05)
            next_ids = _ids(url, secret, next_body)
            n = _cached(url, secret, next_ids)
            if n > 0:
                info = _seam(url, secret, "/hetero/info")
                if info["family"] != "llama":
                    raise RuntimeError(f"--state saves llama-family decoders only, not "
                                       f"{info['family']}")
                out = f"checkpoint-{os.getpid()}.safetensors"
                dumped = _seam(url, secret, "/hetero/cache", {"ids": next_ids, "B": n, "out": out})
                cache = self.dir / f"cache-{len(rows)}.safetensors"
                shutil.move(dumped["path"], cache)
                state.update(B=n, ids=next_ids[:n], T=len(next_ids), cache=cache.name,
                             **{k: info[k] for k in ("family", "fingerprint", "layers")})
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.file)
        for old in self.dir.glob("cache-*.safetensors"):  # earlier turns' rows
            if old.name != state.get("cache"):
                old.unlink()

    def restore(self, decoder: Tuple[str, str], store: Path, state: dict) -> None:
        """Mounts the saved rows into a fresh stack's decoder (whose store is `store`)."""
        if state["B"] == 0:
            return
        url, secret = decoder
        info = _seam(url, secret, "/hetero/info")
        if info["fingerprint"] != state["fingerprint"]:
            raise RuntimeError(f"the saved rows are for decoder {state['fingerprint']}, this one "
                               f"is {info['fingerprint']}")
        entry = store / "resume"
        entry.mkdir(parents=True, exist_ok=True)
        meta = {"format": STORE_FORMAT, **{k: state[k] for k in ("family", "fingerprint", "B",
                                                                   "T", "layers", "ids")}}
        (entry / "entry.json").write_text(json.dumps(meta))
        (entry / "cache.safetensors").unlink(missing_ok=True)
        os.link(self.dir / state["cache"], entry / "cache.safetensors")
        ids = state["ids"] + [0]  # mount needs a request longer than the rows
        _seam(url, secret, "/hetero/mount", {"ids": ids, "entry": "resume"})
        held = _cached(url, secret, ids)
        if held != state["B"]:
            raise RuntimeError(f"mounted {state['B']} rows, the decoder reuses {held}")
