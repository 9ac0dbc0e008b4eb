"""The stack the front-door tests run on: real processes on free ports (the MLX decoder with its
seam, `hetero prefill` hosts with or without injected faults, `hetero front`), and the request
helpers the tests share. Not a test module; test_front.py and test_verdicts.py import it."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import pytest

requests = pytest.importorskip("requests")
openai = pytest.importorskip("openai")

from seam_server import wait_cached  # noqa: E402,F401 (the tests import it from here too)

from hetero_mlx.access import signed_headers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HETERO = Path(os.environ.get("HETERO_BIN", ROOT / "build" / "hetero"))
TINY = Path(os.environ.get("HETERO_TEST_MODEL", ROOT / "models" / "tiny-llama"))
REAL = Path(os.environ.get("HETERO_MODEL", ROOT / "models" / "smollm2-135m-instruct"))
PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "python"))

# The tiny front bridges prompts of >= 64 tokens (the chat template alone is ~30).
MIN_TOKENS = 64
CHUNK = 16  # fault prefill hosts: several segments for a ~150-token prompt
MODEL_NAME = "default_model"  # mlx-lm's name for the model it was started with


def need(path: Path, what: str) -> None:
    if not path.exists():
        pytest.skip(f"{what} missing at {path} (run: make model tiny build)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- processes


def children_of(pid: int) -> List[int]:
    """The pids whose parent is pid (from /proc)."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
    return kids


class Proc:
    """One real process with its log file; stopped by pid (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, argv: List[str], log_dir: Path, port: int, health: str):
        self.name, self.port, self.health = name, port, health
        self.log_path = log_dir / f"{name}-{port}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen([str(a) for a in argv], cwd=ROOT, env=ENV,
                                      stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.popen.returncode}:\n{self.log()[-3000:]}")
            try:
                if requests.get(f"http://127.0.0.1:{self.port}{self.health}", timeout=2).ok:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"{self.name} not healthy within {timeout}s:\n{self.log()[-3000:]}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        self._log.close()


def export_weights(model: Path, out: Path) -> Path:
    subprocess.run([PY, "-m", "hetero_mlx", "export", "--model", str(model), "--out", str(out)],
                   check=True, env=ENV, capture_output=True, cwd=ROOT)
    return out


class Stack:
    """A decoder (shared), prefill hosts and fronts started on demand, stopped at the end."""

    def __init__(self, model: Path, tmp: Path, decoder_args: tuple = ()):
        self.model, self.tmp = model, tmp
        self.store = tmp / "store"
        self.store.mkdir()
        self.weights = export_weights(model, tmp / "weights")
        self.procs: List[Proc] = []
        self._cache: Dict[tuple, Proc] = {}
        self.decoder = self._start("decoder", [PY, "-m", "hetero_mlx", "serve", "--model", model,
                                               "--store", self.store, "--test-faults",
                                               *decoder_args],
                                   "/hetero/info", 300)
        self.info = requests.get(self.url(self.decoder.port, "/hetero/info"), timeout=10).json()

    def _start(self, name: str, argv: List, health: str, timeout: float = 60,
               port: Optional[int] = None) -> Proc:
        port = port or free_port()
        p = Proc(name, argv + ["--port", port], self.tmp, port, health)
        self.procs.append(p)
        return p.wait_ready(timeout)

    @staticmethod
    def url(port: int, path: str) -> str:
        return f"http://127.0.0.1:{port}{path}"

    def prefill(self, fault: str = "", chunk: int = CHUNK, model: Optional[Path] = None,
                weights: Optional[Path] = None, fresh: bool = False,
                port: Optional[int] = None, extra: tuple = ()) -> Proc:
        """A prefill host; reused per (fault, chunk, model, extra flags) unless fresh (faults
        that kill it) or on a given port."""
        key = ("prefill", fault, chunk, str(model), str(weights), tuple(map(str, extra)))
        if not fresh and not port and key in self._cache and self._cache[key].popen.poll() is None:
            return self._cache[key]
        argv = [HETERO, "prefill", "--model", model or self.model, "--weights",
                weights or self.weights, "--chunk", chunk]
        if fault:
            argv += ["--fault", fault]
        argv += list(extra)
        p = self._start("prefill", argv, "/health", port=port)
        if not port:
            self._cache[key] = p
        return p

    def front(self, prefill_port: int, **opts) -> Proc:
        """A front door on the shared decoder; reused per (prefill port, options)."""
        # The fixed minimums unless a test asks otherwise: what these tests expect of a route
        # must not move with the costs the front measures as they run.
        opts = {"bridge-min-tokens": MIN_TOKENS, "bridge-min-tail": MIN_TOKENS,
                "route-by": "min-tail", **opts}
        key = ("front", prefill_port, tuple(sorted(opts.items())))
        if key in self._cache and self._cache[key].popen.poll() is None:
            return self._cache[key]
        argv = [HETERO, "front", "--decoder-port", self.decoder.port, "--prefill-port",
                prefill_port, "--store", self.store]
        for k, v in opts.items():
            argv += [f"--{k}", v]
        p = self._start("front", argv, "/health")
        self._cache[key] = p
        return p

    def clear(self) -> None:
        Decoder(self.decoder.port).clear()

    def cached(self, ids: List[int]) -> int:
        return Decoder(self.decoder.port).cached(ids)

    def native(self, body: dict, path: str = "/v1/chat/completions") -> dict:
        return Decoder(self.decoder.port).native(body, path)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


class Decoder:
    """Direct calls to a decoder's seam and server (with the stack's secret when it has one)."""

    def __init__(self, port: int, secret: str = ""):
        self.port = port
        self.secret = secret

    def post(self, path: str, body: dict, timeout: float = 30) -> dict:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.secret:  # every request signed (docs/design/auth.md)
            headers.update(signed_headers(self.secret, "POST", path, data))
        r = requests.post(Stack.url(self.port, path), data=data, headers=headers,
                          timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()

    def clear(self) -> None:
        self.post("/hetero/clear", {})

    def cached(self, ids: List[int]) -> int:
        return self.post("/hetero/cached_prefix", {"ids": ids})["cached_tokens"]

    def native(self, body: dict, path: str = "/v1/chat/completions", settle: bool = True) -> dict:
        """The decoder's own answer to body, computed cold; leaves the prompt cache empty, or
        with settle=False as the request left it (for a last request, and for caches the probe
        below cannot read: a sliding window's past its window cannot be trimmed to a prefix)."""
        ids = self.post("/hetero/tokenize", body, timeout=60)["ids"]
        self.clear()
        reply = self.post(path, body, timeout=600)
        if not settle:
            return reply
        # Then clear, or the front would find this prompt warm.
        wait_cached(self.cached, ids)
        self.clear()
        assert self.cached(ids) == 0
        return reply


@contextmanager
def running_stack(model: Path, tmp: Path, what: str, decoder_args: tuple = ()) -> Iterator[Stack]:
    """A Stack on `model` (skipping when the binary or the model is missing), stopped after;
    decoder_args: more flags for the decoder's `serve`."""
    need(HETERO, "hetero binary")
    need(model / "config.json", what)
    stack = Stack(model, tmp, decoder_args)
    try:
        yield stack
    finally:
        stack.stop()


def kill_with_children(proc: subprocess.Popen) -> None:
    """Stops a `hetero up` that did not stop itself, and what it started, by pid."""
    if proc.poll() is not None:
        return
    kids = children_of(proc.pid)
    proc.kill()
    proc.wait()
    for k in kids:
        try:
            os.kill(k, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_up(tmp_path: Path, model: Path = TINY):
    """A `hetero up` on `model`, waited for until it says it is up: (process, log, ports)."""
    need(HETERO, "hetero binary")
    need(model / "config.json", "the model")
    port, dport, pport = free_port(), free_port(), free_port()
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen(
            [str(HETERO), "up", "--port", str(port), "--decoder-port", str(dport),
             "--prefill-port", str(pport), "--work-dir", str(tmp_path / "work"), "--model",
             str(model), "--python", PY], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=ENV)
    try:
        deadline = time.monotonic() + 300
        while "hetero is up" not in log_path.read_text(errors="replace"):
            assert up.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
    except BaseException:
        kill_with_children(up)
        raise
    return up, log_path, (port, dport, pport)


# ---------------------------------------------------------------- requests and prompts

WORDS = ("river copper lantern orbit meadow cipher harbor velvet glacier summit ember quartz "
         "tundra falcon prism willow canyon beacon marble thistle cobalt saffron harvest "
         "anchor pepper violin crater ribbon walnut signal dune").split()


def text(tag: str, words: int) -> str:
    """Distinct, deterministic filler: a tag then seeded random words (cold for the decoder)."""
    rng = random.Random(tag)
    return tag + ": " + " ".join(rng.choice(WORDS) for _ in range(words))


def chat(content: str, max_tokens: int = 16, **extra) -> dict:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0.0}
    body.update(extra)
    return body


def answer(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def verdict_of(headers) -> dict:
    raw = headers.get("X-PD-Bridge")
    assert raw, f"no X-PD-Bridge header in {dict(headers)}"
    v = json.loads(raw)
    assert {"verdict", "B", "T", "bytes", "timings_ms"} <= set(v), v
    return v


def post_front(front: Proc, body, path: str = "/v1/chat/completions", mode: str = "",
               timeout: float = 600, secret: str = ""):
    """A request to a front door; mode forces the route (X-PD-Bridge-Mode). A front door with
    the stack's secret honours a forced bridge only when the request is signed with it too
    (X-Hetero-Signature, as hetero doctor sends it): pass that secret."""
    headers = {"Content-Type": "application/json"}
    if mode:
        headers["X-PD-Bridge-Mode"] = mode
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    if mode == "bridge" and secret:
        raw = data.encode() if isinstance(data, str) else data
        headers["X-Hetero-Signature"] = signed_headers(secret, "POST", path,
                                                       raw)["Authorization"]
    return requests.post(Stack.url(front.port, path), data=data, headers=headers, timeout=timeout)


def warm_turn(decoder: "Decoder", front: Proc, body: dict) -> tuple:
    """One turn of a conversation through the front door: (its ids, what the decoder held of
    them before, the reply, its verdict)."""
    ids = decoder.post("/hetero/tokenize", body)["ids"]
    held = decoder.cached(ids)
    r = post_front(front, body)
    assert r.status_code == 200, r.text
    return ids, held, r, verdict_of(r.headers)


def cached_tokens(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def metrics(front: Proc) -> Dict[str, float]:
    out = {}
    for line in requests.get(Stack.url(front.port, "/metrics"), timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def client(front: Proc) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"http://127.0.0.1:{front.port}/v1", api_key="unused",
                         max_retries=0, timeout=600)


def openai_chat(front: Proc, body: dict, stream: bool):
    """(answer text, verdict, usage or None) through the official client."""
    kwargs = dict(body)
    c = client(front)
    if not stream:
        raw = c.chat.completions.with_raw_response.create(**kwargs)
        comp = raw.parse()
        return comp.choices[0].message.content, verdict_of(raw.headers), comp.usage
    with c.chat.completions.with_streaming_response.create(stream=True, **kwargs) as resp:
        v = verdict_of(resp.headers)
        parts = [ch.choices[0].delta.content or "" for ch in resp.parse() if ch.choices]
    return "".join(parts), v, None
