"""The /hetero/* endpoints, added to mlx-lm's own APIHandler on the server's own port.

Every request on the port is first admitted: signed when the seam has a secret (access.py), its
body framed, sized and read whole within the connection's deadline (bounds.py). Paths under
/hetero/ are then answered here; every other request goes to APIHandler, except that a completion
request is checked first: naming another model, adapters or draft model than the served ones
(mlx-lm would drop its model to load them), or carrying a field that would kill the generation
thread (checks.py), it is refused; its tenant salt is taken out of the body (tenants.py); and it
runs with a RequestGenerator that stops it when its caller hangs up (cancel.py). Every seam reply
is JSON without CORS headers; errors are {"error": {"code", "message"}} with a 4xx/5xx status,
and nothing a client sends can raise out of a handler. Access rules: access.py.

Every body below may carry "hetero_cache_salt" (tenants.py): the prompt-cache partition it
reads or writes.

  POST /hetero/tokenize       OpenAI chat or completions body -> {"ids", "n", "segments",
                              "cached_tokens", "path", "calls"} (the prefill calls the decoder
                              would run it in now: schedule.py)
  GET  /hetero/info           model layout, fingerprint, versions, prompt-cache stats, requests
                              in flight, connections (503 generation_dead once mlx-lm's
                              generation thread has died)
  POST /hetero/cached_prefix  {"ids"} -> {"cached_tokens", "n"} (read-only)
  POST /hetero/mount          {"entry", "ids"} -> {"mounted": B, "pin"} (pins.py); a tail entry
                              (rows from "start") extends the decoder's own cache of ids[:start]
  POST /hetero/unpin          {"pin", "evict"?} -> {"released": bool, "evicted": bool}
  POST /hetero/cache          {"ids", "B", "out": name} -> {"B", "path"} (truth dump into
                              <store>/dumps/name; the prompt cache is only read)
  POST /hetero/clear          -> {"cleared": number of entries dropped} (every partition, every
                              pin; a new epoch: tenants.py)
  POST /hetero/fault          {"kind"} -> {"armed"} (serve --test-faults only; pins.py)
  POST /hetero/calls          -> {"calls": [tokens per model call since the last read]}
                              (serve --test-faults only; schedule.CallRecorder)
"""

import io
import json
import logging
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import trim_prompt_cache
from mlx_lm.server import APIHandler, ModelProvider

from . import STORE_FORMAT
from .access import RequestAuth, check_json_body, write_dump
from .bounds import body_length, loads_bounded
from .cancel import ClientGone, Liveness, RequestGenerator
from .checks import check_completion_body
from .errors import SeamError, bad_request
from .llama import build_cache, cache_arrays, context_window, extend_cache
from .pins import unpin_request
from .prompt_cache import LockedPromptCache
from .schedule import CallRecorder, decoder_calls
from .store import dump_request, entry_path, read_entry, request_ids
from .tenants import partition, take_salt

log = logging.getLogger("hetero_mlx")

PREFIX = "/hetero/"


@dataclass
class Seam:
    """What the seam endpoints share: the server's own provider and prompt cache."""

    provider: ModelProvider
    prompt_cache: LockedPromptCache
    desc: Dict[str, Any]  # llama.describe() of the loaded model
    store: Optional[Path]
    dumps: Optional[Path] = None  # access.dumps_dir(store): where /hetero/cache writes
    auth: Optional[RequestAuth] = None  # every request must be signed (access.py)
    calls: Optional[CallRecorder] = None  # serve --test-faults only
    liveness: Liveness = field(default_factory=Liveness)  # cancel.py

    @property
    def model_key(self) -> Any:
        return self.provider.model_key

    def key(self, salt: str) -> Any:
        """The prompt cache's key for a tenant's partition (tenants.py)."""
        return partition(self.provider.model_key, salt)


class _ProbeDone(Exception):
    """Ends do_POST's dry run once the request has been tokenized."""


class _TokenizeProbe:
    """Stands in for the ResponseGenerator during a dry run of APIHandler.do_POST.

    do_POST parses the body, validates it and builds the CompletionRequest and
    GenerationArguments; generate() then receives exactly those objects, tokenizes them with
    the server's own ResponseGenerator._tokenize, and stops before anything is generated.
    """

    def __init__(self, generator: Any):
        self._generator = generator
        self.result: Optional[tuple] = None
        self.error: Optional[Exception] = None
        self.batched = False  # which prefill path the server would take (schedule.py)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._generator, name)

    def generate(self, request: Any, args: Any, progress_callback: Any = None):
        generator = self._generator
        try:
            tokenizer = generator.model_provider.tokenizer
            self.result = generator._tokenize(tokenizer, request, args)
            self.batched = generator._is_batchable(args)
        except Exception as e:  # template errors, bad message content: reported as 400
            self.error = e
        raise _ProbeDone()


def _openai_path(body: Dict[str, Any]) -> str:
    """The OpenAI endpoint the body was written for, after checks mlx-lm itself skips."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad_request("bad_messages", "messages must be a non-empty list")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise bad_request("bad_messages", "each message must be an object with a role")
        return "/v1/chat/completions"
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("bad_prompt", "prompt must be a non-empty string")
        return "/v1/completions"
    raise bad_request("missing_prompt", "body has neither messages nor prompt")


# mlx-lm's completion endpoints. A request there names a model, adapters and a draft model, and
# the generation thread loads whatever they map to (ModelProvider.load), dropping the served
# model first, even when the load then fails.
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")


def check_served_model(provider: ModelProvider, body: Dict[str, Any]) -> None:
    """Refuses a request that would make mlx-lm load anything: its model, adapters and draft
    model must map, as ModelProvider.load maps them, to the ones it started with. Accepted
    model names: "default_model" (what the front door forwards) and --model as given."""
    model_map = provider._model_map
    adapter_map, draft_map = provider._adapter_map, provider._draft_model_map
    served = (model_map["default_model"], adapter_map["default_model"], draft_map["default_model"])
    model = body.get("model", "default_model")
    if not isinstance(model, str) or model_map.get(model, model) != served[0]:
        raise SeamError(
            404,
            "model_not_served",
            f"model {model!r} is not served here; this decoder serves {served[0]!r} (also "
            "named 'default_model') and loads no other",
        )
    adapter = adapter_map.get(model, body.get("adapters"))
    if adapter != served[1]:
        raise bad_request("adapter_not_served", f"adapters {adapter!r} are not served here")
    draft = body.get("draft_model", "default_model")
    if not (draft is None or isinstance(draft, str)) or draft_map.get(draft, draft) != served[2]:
        raise bad_request("draft_model_not_served", f"draft_model {draft!r} is not served here")


def _rejection(raw: bytes) -> SeamError:
    """The error do_POST wrote during a dry run, as a seam error."""
    head, _, payload = raw.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
        message = json.loads(payload).get("error", "")
    except (ValueError, IndexError, AttributeError):
        status, message = 400, payload.decode(errors="replace")
    status = status if 400 <= status < 500 else 400
    return SeamError(status, "rejected_by_server", f"mlx-lm rejected the request: {message}")


def run_capturing(owner: Any, name: str, main: Callable[[], Any], argv: List[str]) -> tuple:
    """Runs a decoder's own CLI `main` with sys.argv = argv while `owner.name` (the call that
    would start serving) is swapped for a recorder; returns that call's (args, kwargs). The
    decoder's option parsing and startup stay its own; only the final serve call is ours."""
    captured = []

    def record(*args: Any, **kwargs: Any) -> None:
        captured.append((args, kwargs))

    saved, saved_argv = getattr(owner, name), sys.argv
    setattr(owner, name, record)
    sys.argv = argv
    try:
        main()
    finally:
        setattr(owner, name, saved)
        sys.argv = saved_argv
    if not captured:
        raise SystemExit(f"hetero_mlx: {argv[0]} exited without starting its server")
    return captured[0]


def parse_body(raw: bytes) -> Dict[str, Any]:
    """A /hetero/ request body: empty, or a JSON object (nesting bounded); else a 400."""
    if not raw.strip():
        return {}
    body = loads_bounded(raw)
    if not isinstance(body, dict):
        raise bad_request("bad_json", "request body must be a JSON object")
    return body




class SeamHandler(APIHandler):
    """mlx-lm's APIHandler plus the /hetero/ routes; built by functools.partial with a Seam.

    Every request, whatever its path, is first admitted (_admit): signed when the seam has a
    secret (access.py), its body framed and sized (bounds.py) and read whole within the
    connection's deadline. mlx-lm's own handlers then read that body from a buffer."""

    # Each socket read or write may block this long (BaseHTTPRequestHandler's own timeout);
    # the whole request must come sooner still (bounds.py).
    timeout = 120

    def __init__(self, response_generator: Any, *args: Any, seam: Seam, **kwargs: Any):
        # BaseHTTPRequestHandler serves the request inside __init__, so set state first.
        self.seam = seam
        self._probing = False
        super().__init__(response_generator, *args, **kwargs)

    def handle_one_request(self):
        super().handle_one_request()
        bounds = getattr(self.server, "bounds", None)
        if bounds is not None:  # the next request's deadline runs from this response
            bounds.waiting(self.connection)

    # ---- admission -----------------------------------------------------------------------

    def _admit(self) -> Optional[bytes]:
        """The request's body once it may be served; None when it was refused (the reply, if
        any, is sent). Order (auth.md): the Authorization header and the clock before the body
        is read, the body within its size limit, then its signature and nonce."""
        auth, creds = self.seam.auth, None
        try:
            if auth is not None:
                creds = auth.check_header(self.headers.get("Authorization"))
            n_bytes = body_length(self.headers, getattr(self.server, "max_body_bytes", 64 << 20))
        except SeamError as e:
            self.close_connection = True  # the body stays unread on the connection
            self._reply(e.status, e.body(), e.headers)
            return None
        raw = self.rfile.read(n_bytes) if n_bytes else b""
        bounds = getattr(self.server, "bounds", None)
        if len(raw) < n_bytes or (bounds is not None and not bounds.arrived(self.connection)):
            self.close_connection = True  # the client left, or its deadline passed
            return None
        if creds is not None:
            try:
                auth.check_body(creds, self.command, self.path, raw)
            except SeamError as e:
                self._reply(e.status, e.body(), e.headers)
                return None
        return raw

    @contextmanager
    def _body_for_mlx(self, raw: bytes) -> Iterator[None]:
        """mlx-lm's handlers read the body from rfile by Content-Length: give them `raw`."""
        saved = self.rfile, self.headers.get_all("Content-Length")
        self.rfile = io.BytesIO(raw)  # the connection stays ours
        del self.headers["Content-Length"]
        self.headers["Content-Length"] = str(len(raw))
        try:
            yield
        finally:
            self.rfile = saved[0]
            del self.headers["Content-Length"]
            for value in saved[1] or []:
                self.headers["Content-Length"] = value

    # ---- routing -------------------------------------------------------------------------

    def do_GET(self):
        raw = self._admit()
        if raw is None:
            return
        if not self.path.startswith(PREFIX):
            return super().do_GET()
        self._dispatch({"/hetero/info": SeamHandler._info}, raw, has_body=False)

    def do_OPTIONS(self):
        # mlx-lm approves every preflight; a browser must never get a cross-origin JSON request
        # (or an Authorization header) through to the seam.
        if self._admit() is None:
            return
        if not self.path.startswith(PREFIX):
            return super().do_OPTIONS()
        error = SeamError(405, "method_not_allowed", "the seam answers no CORS preflight")
        self._reply(error.status, error.body(), {"Allow": "GET, POST"})

    def do_POST(self):
        raw = self._admit()
        if raw is None:
            return
        if self.path in COMPLETION_PATHS:
            return self._completion(raw)
        if not self.path.startswith(PREFIX):
            with self._body_for_mlx(raw):
                return super().do_POST()
        routes = {
            "/hetero/tokenize": SeamHandler._tokenize_endpoint,
            "/hetero/cached_prefix": SeamHandler._cached_prefix,
            "/hetero/mount": SeamHandler._mount,
            "/hetero/cache": SeamHandler._cache_dump,
            "/hetero/clear": SeamHandler._clear,
            "/hetero/unpin": SeamHandler._unpin,
            "/hetero/fault": SeamHandler._fault,
            "/hetero/calls": SeamHandler._calls,
        }
        self._dispatch(routes, raw, has_body=True)

    def _dispatch(self, routes: Dict[str, Any], raw: bytes, has_body: bool):
        route = routes.get(self.path.split("?", 1)[0])
        headers: Dict[str, str] = {}
        try:
            if route is None:
                raise SeamError(404, "not_found", f"no seam endpoint {self.command} {self.path}")
            if has_body:
                check_json_body(self.headers.get("Content-Type"))
                status, reply = 200, route(self, raw, parse_body(raw))
            else:
                status, reply = 200, route(self)
        except SeamError as e:
            status, reply, headers = e.status, e.body(), e.headers
        except Exception as e:  # a bug, not a client error: still a JSON reply
            log.exception("seam %s failed", self.path)
            status, reply = 500, {"error": {"code": "internal", "message": str(e)}}
        self._reply(status, reply, headers)

    def _completion(self, raw: bytes):
        """mlx-lm's own completion handling, after the seam's checks of the body (the served
        model; fields that would kill the generation thread: checks.py; the tenant's salt,
        taken out of the body), with a RequestGenerator in place of the server's generator:
        a caller that hangs up stops its generation (cancel.py), and the request's prompt-cache
        traffic stays in its salt's partition (tenants.py)."""
        try:
            body = parse_body(raw)
            check_served_model(self.seam.provider, body)
            salt = take_salt(body)
            check_completion_body(body, self.seam.desc["vocab_size"])
        except SeamError as e:
            log.warning("refused %s: %s", self.path, e.message)
            return self._reply(e.status, e.body(), e.headers)
        if salt:
            raw = json.dumps(body).encode()
        tenants = self.seam.prompt_cache.tenants
        requests = RequestGenerator(
            self.response_generator, self.connection, tenants.tag(salt), tenants,
            self.seam.liveness,
        )
        saved, self.response_generator = self.response_generator, requests
        try:
            with self._body_for_mlx(raw):
                super().do_POST()
        except ClientGone:
            self.close_connection = True
        finally:
            self.response_generator = saved
            requests.close()

    def _reply(
        self, status: int, reply: Dict[str, Any], headers: Optional[Dict[str, str]] = None
    ):
        # Not _set_completion_headers: it adds mlx-lm's CORS headers.
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def log_request(self, code: Any = "-", size: Any = "-"):
        # The tokenize dry run answers into a buffer; its status line is not a real reply.
        if not self._probing:
            super().log_request(code, size)

    # ---- endpoints -----------------------------------------------------------------------

    def _info(self) -> Dict[str, Any]:
        if not self.response_generator.generation_available():
            # mlx-lm's generation thread died (its /health says "unavailable"): every request
            # would fail from now on. The front door must stop sending here.
            raise SeamError(
                503, "generation_dead", "the decoder's generation thread has died; restart it"
            )
        if self.seam.provider.model is None:
            # mlx-lm drops its model when a request names one it cannot load; say so plainly.
            raise SeamError(503, "no_model", "the decoder has no model loaded")
        desc, cache = self.seam.desc, self.seam.prompt_cache
        keys = ("family", "model_type", "fingerprint", "layers", "kv_heads", "head_dim")
        keys += ("hidden", "vocab_size", "dtype", "rope", "qk_norm", "kv_bias", "quantization")
        keys += ("sliding_window",)
        info = {k: desc[k] for k in keys}
        info.update(
            model=self.seam.provider.cli_args.model,
            prefill_step_size=self.seam.provider.cli_args.prefill_step_size,
            store_format=STORE_FORMAT,
            store=str(self.seam.store) if self.seam.store else None,
            versions={"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__},
            # The front door refuses prompts that cannot fit, before anything runs.
            context_window=context_window(self.seam.provider.model.args),
        )
        # Without the cache's lock: the supervisor asks this every few seconds, and a busy
        # generation thread holds the lock for whole lookups (stats read racily are fine).
        sequences, nbytes = cache.stats_unlocked()
        info["prompt_cache"] = {"sequences": sequences, "bytes": nbytes}
        info["partitions"] = {
            "epoch": cache.tenants.epoch,
            "in_flight": cache.tenants.in_flight(),
            "dropped_inserts": cache.tenants.dropped,
        }
        info["requests"] = self.seam.liveness.stats()
        bounds = getattr(self.server, "bounds", None)
        if bounds is not None:
            info["connections"] = bounds.stats()
        return info

    def _tokenize_endpoint(self, raw: bytes, body: Dict[str, Any]) -> Dict[str, Any]:
        salt = take_salt(body)
        (prompt, segments, types, _, vision), batched = self._server_tokenize(body)
        if vision is not None:
            # The server keys image prompts by a rewritten id list; the seam does not mount them.
            raise bad_request("images_unsupported", "prompts with images are not bridged")
        ids = [int(t) for t in prompt]
        parts = [{"type": t, "n": len(s)} for t, s in zip(types, segments)]
        cached = self.seam.prompt_cache.reuse_length(self.seam.key(salt), ids)
        step = self.seam.provider.cli_args.prefill_step_size
        # A prompt the cache holds whole has no prefill to cut (the server refuses it).
        calls = decoder_calls([len(s) for s in segments], cached, step, batched) if cached < len(
            ids
        ) else []
        return {
            "ids": ids,
            "n": len(ids),
            "segments": parts,
            "cached_tokens": cached,
            "path": "batch" if batched else "single",
            "calls": [list(c) for c in calls],
        }

    def _server_tokenize(self, body: Dict[str, Any]) -> tuple:
        """Runs APIHandler.do_POST on the body (its salt taken out) with a probe in place of
        the generator: (ResponseGenerator._tokenize's result, whether the server would batch
        the request).

        This is the server's own path: its parsing, validation, request and argument objects,
        and ResponseGenerator._tokenize. Its output goes to a buffer, read only on rejection.
        """
        path = _openai_path(body)
        check_served_model(self.seam.provider, body)
        check_completion_body(body, self.seam.desc["vocab_size"])
        probe, sink = _TokenizeProbe(self.response_generator), io.BytesIO()
        saved = (self.path, self.wfile, self.response_generator)
        self.path, self.wfile = path, sink
        self.response_generator, self._probing = probe, True
        try:
            with self._body_for_mlx(json.dumps(body).encode()):
                APIHandler.do_POST(self)
        finally:
            self.path, self.wfile, self.response_generator = saved
            self._probing = False
        if probe.error is not None:
            raise bad_request("tokenize_failed", f"{type(probe.error).__name__}: {probe.error}")
        if probe.result is None:
            raise _rejection(sink.getvalue())
        return probe.result, probe.batched

    def _cached_prefix(self, raw: bytes, body: Dict[str, Any]) -> Dict[str, Any]:
        key = self.seam.key(take_salt(body))
        ids = request_ids(body, self.seam.desc["vocab_size"])
        cached = self.seam.prompt_cache.reuse_length(key, ids)
        return {"cached_tokens": cached, "n": len(ids)}

    def _mount(self, raw: bytes, body: Dict[str, Any]) -> Dict[str, Any]:
        prompt_cache = self.seam.prompt_cache
        epoch = prompt_cache.tenants.epoch  # a clear from now on refuses the mount
        key = self.seam.key(take_salt(body))
        ids = request_ids(body, self.seam.desc["vocab_size"])
        entry = read_entry(entry_path(body, self.seam.store), ids, self.seam.desc, tails=True)
        # Built and evaluated outside the lock: only the insert touches shared state.
        if entry.start > 0:
            cache = self._extend(key, ids, entry)
        else:
            cache = build_cache(self.seam.provider.model, entry.arrays, entry.n_tokens)
        prefix = list(ids[: entry.n_tokens])
        with prompt_cache.lock:  # no lookup between the insert and the pin
            if not prompt_cache.insert_into(key, prefix, cache, epoch, cache_type="user"):
                raise SeamError(409, "cleared", "the prompt cache was cleared during the mount")
            pin = prompt_cache.pins.add(prefix, (key, cache))
        log.info("mounted %d tokens from %s (pin %s)", entry.n_tokens, body["entry"], pin)
        return {"mounted": entry.n_tokens, "pin": pin}

    def _extend(self, key: Any, ids: List[int], entry: Any) -> List[Any]:
        """A tail's entry on top of the decoder's own cache of ids[:start]: a copy of the entry
        it holds for those tokens (trimmed to them, as its own lookup trims), extended by the
        tail's rows. The tail was computed for exactly these ids and this fingerprint (checked
        by read_entry); a decoder that no longer holds them refuses, and the request goes
        native."""
        start = entry.start
        with self.seam.prompt_cache.lock:
            cache, rest = self.seam.prompt_cache.peek_nearest_cache(key, list(ids[: start + 1]))
        covered = start + 1 - len(rest)
        if cache is None or covered < start:
            raise SeamError(
                409,
                "prefix_not_cached",
                f"the tail extends the decoder's cache of {start} tokens; it holds "
                f"{covered if cache is not None else 0} of them",
            )
        if covered > start and trim_prompt_cache(cache, covered - start) != covered - start:
            raise SeamError(409, "prefix_not_cached", "the decoder's cache cannot be trimmed")
        try:
            return extend_cache(cache, entry.arrays, entry.n_tokens)
        except ValueError as e:
            raise SeamError(409, "layout_mismatch", str(e)) from None

    def _unpin(self, raw: bytes, body: Dict[str, Any]) -> Dict[str, Any]:
        cache = self.seam.prompt_cache
        return unpin_request(cache.pins, body, lambda pin: cache.evict(pin.payload[0], list(pin.prefix)))

    def _fault(self, raw: bytes, body: Dict[str, Any]) -> Dict[str, Any]:
        return self.seam.prompt_cache.pins.arm(body)

    def _calls(self, raw: bytes, body: Dict[str, Any]) -> Dict[str, Any]:
        if self.seam.calls is None:
            raise SeamError(404, "not_found", "the call recorder is off (serve --test-faults)")
        return {"calls": self.seam.calls.take()}

    def _cache_dump(self, raw: bytes, body: Dict[str, Any]) -> Dict[str, Any]:
        key = self.seam.key(take_salt(body))
        ids = request_ids(body, self.seam.desc["vocab_size"])
        n, out = dump_request(body, ids, self.seam.dumps)
        arrays = self._native_arrays(key, ids[:n])
        metadata = {"format": STORE_FORMAT, "B": str(n)}
        write_dump(out, lambda tmp: mx.save_safetensors(tmp, arrays, metadata=metadata))
        return {"B": n, "path": str(out)}

    def _native_arrays(self, key: Any, prefix: List[int]) -> Dict[str, mx.array]:
        """The server's own cached rows for exactly `prefix`, read without changing the cache.

        One extra token makes fetch_nearest_cache trim a longer entry to exactly the prefix
        (it always leaves the last queried token uncached); fetch returns a deep copy.
        """
        cache_obj = self.seam.prompt_cache
        with cache_obj.lock:
            cache, rest = cache_obj.peek_nearest_cache(key, prefix + [0])
            covered = len(prefix) + 1 - len(rest)
            if cache is None or covered < len(prefix):
                raise SeamError(
                    404, "not_cached", f"the prompt cache covers {covered} of {len(prefix)} tokens"
                )
            return cache_arrays(cache, len(prefix))

    def _clear(self, raw: bytes, body: Dict[str, Any]) -> Dict[str, Any]:
        # Every partition, every pin, and a new epoch: nothing computed for a request admitted
        # before this clear enters the cache after it (tenants.py).
        return {"cleared": self.seam.prompt_cache.clear()}
