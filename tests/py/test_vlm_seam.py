"""End-to-end tests of the DeepSeek-V4 decoder seam (python/hetero_mlx/vlm_serve.py) against
mlx-vlm's own server.

Starts `python -m hetero_mlx serve` on a tiny DeepSeek-V4 checkpoint (HETERO_DSV4_MODEL: a model
directory, or the root `tiny-dsv4` writes, whose bf16/ variant is used on Metal and mxfp4/ on
MLX's CPU backend, where gather_mm, the bf16 variant's routed experts, runs in float32 only)
and talks HTTP to it: tokenization is what the server processes, a native request leaves
checkpoints that cached_prefix reports, a store entry made from the server's own dump is
reused as an ordinary prefix hit and answers exactly as the native cold request did, and every
bad input gets a 4xx JSON error while the prefix cache stays untouched.

The server runs with APC checkpoints every 32 tokens (4 kept), so a prompt leaves checkpoints
inside it as well as the one before its last token, and mounts with long tails are tested too.
"""

import json
import os
from pathlib import Path

import pytest
from seam_server import (SignedAuth, get, info, ok, openai_http_client, post, request,
                         seam_server, signed)

from hetero_mlx.access import signed_headers

mx = pytest.importorskip("mlx.core")
requests = pytest.importorskip("requests")
pytest.importorskip("mlx_vlm")

REPO = Path(__file__).resolve().parents[2]
STORE_FORMAT = "hetero-store-v1"
STARTUP_TIMEOUT_S = 180
CHECKPOINT_INTERVAL = 32
SERVER_ENV = {"APC_CHECKPOINT_INTERVAL_TOKENS": str(CHECKPOINT_INTERVAL)}
SERVER_ENV["APC_CHECKPOINT_ENTRIES"] = "4"
SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
# ~85 and ~290 prompt tokens: inside the 128-row window, and past it with ratio-128 pool rows.
SHORT = "Why is the sky blue? Explain it like I am five years old, please, in plain words. " * 3
LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire. " * 15


# ---- server process ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir() -> str:
    root = os.environ.get("HETERO_DSV4_MODEL")
    if not root:
        pytest.skip("HETERO_DSV4_MODEL is not set (e.g. models/dsv4-tiny from tiny-dsv4)")
    path = Path(root)
    if not (path / "config.json").exists():
        # The served variant; bf16 experts cannot run on MLX's CPU backend (gather_mm).
        variant = "bf16" if mx.metal.is_available() else "native"
        path = path / os.environ.get("HETERO_DSV4_VARIANT", variant)
    if not (path / "config.json").exists():
        pytest.skip(f"no DeepSeek-V4 checkpoint at {path}")
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with seam_server(model_dir, tmp_path_factory, "/hetero/info", STARTUP_TIMEOUT_S,
                     extra_env=SERVER_ENV) as srv:
        yield srv


# ---- HTTP helpers --------------------------------------------------------------------------


def chat_body(server, text, **extra):
    body = {"model": server["model"], "messages": [SYSTEM, {"role": "user", "content": text}]}
    body.update({"max_tokens": 8, "temperature": 0, "logprobs": True, **extra})
    return body


def complete(server, body):
    return ok(server, "/v1/chat/completions", body)


def answer_of(reply):
    """The generated text and every token's log-probability: equal only if the logits are."""
    choice = reply["choices"][0]
    return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]


def held_checkpoints(server, ids):
    """Prefix lengths of `ids` at which the server holds a checkpoint (probed by dumping)."""
    n = len(ids)
    candidates = list(range(CHECKPOINT_INTERVAL, n - 1, CHECKPOINT_INTERVAL)) + [n - 1]
    body = lambda b: {"ids": ids, "B": b, "out": "probe.safetensors"}  # noqa: E731
    return [b for b in candidates if post(server, "/hetero/cache", body(b))[0] == 200]


def dump(server, ids, n, name):
    """The server's checkpoint of ids[:n], dumped as <store>/dumps/name: (arrays, window_idx)."""
    reply = ok(server, "/hetero/cache", {"ids": ids, "B": n, "out": name})
    assert reply["B"] == n
    assert Path(reply["path"]) == (server["store"] / "dumps" / name).resolve()
    return mx.load(reply["path"]), reply["window_idx"]


def write_entry(server, name, prompt_ids, n, arrays, slot, **override):
    """A decoder-store entry as the C++ front writes it (window slot index `slot`); `override`
    replaces entry.json keys, and a None there drops the key."""
    desc = info(server)
    path = server["store"] / name
    path.mkdir()
    meta = {"format": STORE_FORMAT, "family": "deepseek_v4", "fingerprint": desc["fingerprint"]}
    meta.update(B=n, T=len(prompt_ids), layers=desc["layers"], ids=prompt_ids[:n])
    meta.update(window_idx=slot)
    meta.update(override)
    meta = {k: v for k, v in meta.items() if v is not None}
    (path / "entry.json").write_text(json.dumps(meta))
    mx.save_safetensors(str(path / "cache.safetensors"), arrays)
    return name


# ---- info and tokenize ---------------------------------------------------------------------


def test_info_describes_the_loaded_model(server):
    desc = info(server)
    assert desc["family"] == "deepseek_v4" and desc["model"] == server["model"]
    assert len(desc["fingerprint"]) == 32 and int(desc["fingerprint"], 16) >= 0
    assert desc["layers"] == len(desc["ratios"]) and desc["window"] == 128
    assert set(desc["ratios"]) <= {0, 4, 128}
    assert desc["prefill_step_size"] == 2048  # mlx-vlm's own default survives
    assert desc["apc"]["checkpoint_interval_tokens"] == CHECKPOINT_INTERVAL
    assert set(desc["versions"]) == {"mlx", "mlx_vlm"}


def test_tokenize_is_what_the_server_processes(server):
    body = chat_body(server, SHORT)
    tokens = ok(server, "/hetero/tokenize", body)
    ids = tokens["ids"]
    assert tokens["n"] == len(ids) > 0
    assert sum(s["n"] for s in tokens["segments"]) == tokens["n"]
    ok(server, "/hetero/clear")
    assert complete(server, body)["usage"]["prompt_tokens"] == len(ids)
    # The server keyed its checkpoint by the ids it processed: all but the last are these.
    assert ok(server, "/hetero/cached_prefix", {"ids": ids})["cached_tokens"] == len(ids) - 1
    assert held_checkpoints(server, ids)[-1] == len(ids) - 1


def test_tokenize_follows_the_chat_template(server):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(server["model"])
    template = Path(server["model"]) / "chat_template.jinja"
    if template.exists():
        tokenizer.chat_template = template.read_text()
    if not tokenizer.chat_template:
        pytest.skip("test model has no chat template")
    body = chat_body(server, SHORT)
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    messages = body["messages"]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(ids) == text


def test_streaming_request_keeps_the_seam_contract(server):
    body = chat_body(server, SHORT, stream=True, stream_options={"include_usage": True})
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    ok(server, "/hetero/clear")
    complete(server, chat_body(server, SHORT))
    r = requests.post(server["url"] + "/v1/chat/completions", json=body, stream=True, timeout=120,
                      auth=SignedAuth(server["secret"]))
    assert r.status_code == 200
    events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
    assert usage[-1]["prompt_tokens"] == len(ids)
    assert usage[-1]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1


# ---- the native prefix cache ---------------------------------------------------------------


def test_native_request_populates_the_cache(server):
    body = chat_body(server, LONG)
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    ok(server, "/hetero/clear")
    assert ok(server, "/hetero/cached_prefix", {"ids": ids}) == {"cached_tokens": 0, "n": len(ids)}
    cold = complete(server, body)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = ok(server, "/hetero/cached_prefix", {"ids": ids})["cached_tokens"]
    assert cached == len(ids) - 1
    assert info(server)["prompt_cache"]["sequences"] == 4  # three interval checkpoints + last
    warm = complete(server, body)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert warm["timings"]["prompt_n"] == len(ids) - cached
    assert answer_of(warm) == answer_of(cold)


# ---- mount ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [SHORT, LONG], ids=["short", "long"])
def test_mount_is_reused_and_answers_as_native(server, text):
    """For every checkpoint a cold request leaves: dump it, clear, mount the dump from a store
    entry, and ask again: the prefix is reused, only the tail is processed, and the answer
    (text and every log-probability) is the cold one."""
    body = chat_body(server, text)
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    ok(server, "/hetero/clear")
    native = answer_of(complete(server, body))
    held = held_checkpoints(server, ids)
    assert held[-1] == len(ids) - 1 and len(held) > 1
    truths = {n: dump(server, ids, n, f"{len(ids)}-truth{n}.safetensors") for n in held}

    for n, (truth, window_idx) in truths.items():
        entry = write_entry(server, f"mount-{len(ids)}-{n}", ids, n, truth, window_idx)
        ok(server, "/hetero/clear")
        assert ok(server, "/hetero/cached_prefix", {"ids": ids})["cached_tokens"] == 0
        mounted = ok(server, "/hetero/mount", {"entry": entry, "ids": ids})
        assert mounted["mounted"] == n and isinstance(mounted["pin"], str) and mounted["pin"]
        assert ok(server, "/hetero/cached_prefix", {"ids": ids})["cached_tokens"] == n

        # The mounted objects hold exactly the arrays mounted (bit-exact: nothing is computed).
        got, got_idx = dump(server, ids, n, f"{len(ids)}-again{n}.safetensors")
        assert got_idx == window_idx and sorted(got) == sorted(truth)
        for name, array in truth.items():
            assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
            assert mx.array_equal(got[name], array).item(), name

        reply = complete(server, body)
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == n, n
        assert reply["timings"]["prompt_n"] == len(ids) - n, n
        assert answer_of(reply) == native, n


def test_openai_client_sees_the_mounted_prefix(server):
    openai = pytest.importorskip("openai")
    body = chat_body(server, SHORT)
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    ok(server, "/hetero/clear")
    native = answer_of(complete(server, body))
    n = held_checkpoints(server, ids)[0]
    truth, window_idx = dump(server, ids, n, "openai-truth.safetensors")
    entry = write_entry(server, "mount-openai", ids, n, truth, window_idx)
    ok(server, "/hetero/clear")
    ok(server, "/hetero/mount", {"entry": entry, "ids": ids})

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused",
                           http_client=openai_http_client(server["secret"]))
    reply = client.chat.completions.create(**body)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.prompt_tokens_details.cached_tokens == n
    assert reply.choices[0].message.content == native[0]


def test_unpin_with_evict_drops_the_mounted_checkpoint(server):
    # The front door's answer to a mount that failed its check: the checkpoint must not stay in
    # mlx-vlm's prefix cache to be served later.
    body = chat_body(server, SHORT)
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    ok(server, "/hetero/clear")
    complete(server, body)
    n = held_checkpoints(server, ids)[0]
    truth, window_idx = dump(server, ids, n, "evict-truth.safetensors")
    entry = write_entry(server, "mount-evict", ids, n, truth, window_idx)
    ok(server, "/hetero/clear")
    pin = ok(server, "/hetero/mount", {"entry": entry, "ids": ids})["pin"]
    assert ok(server, "/hetero/cached_prefix", {"ids": ids})["cached_tokens"] == n
    assert ok(server, "/hetero/unpin", {"pin": pin, "evict": True}) == {"released": True,
                                                                         "evicted": True}
    assert ok(server, "/hetero/cached_prefix", {"ids": ids})["cached_tokens"] == 0


# ---- bad inputs ----------------------------------------------------------------------------


def _bad_cases(server, ids, n, truth, window_idx):
    """(name, path, body or raw bytes, status, code) for every rejected input."""
    desc = info(server)
    entry = lambda name, **kw: write_entry(server, name, ids, n, truth, window_idx, **kw)  # noqa
    with_arrays = lambda name, arrays, **kw: write_entry(  # noqa: E731
        server, name, ids, n, arrays, window_idx, **kw
    )
    window = "layers.0.window"
    pooled = next(k for k in truth if k.endswith("pool.pooled"))
    rows = truth[window].shape[2]
    missing = {k: v for k, v in truth.items() if k != pooled}
    extra = dict(truth, **{"layers.0.pool.pooled": truth[pooled]})
    short_pool = dict(truth, **{pooled: truth[pooled][:, :-1]})
    as_f32 = dict(truth, **{window: truth[window].astype(mx.float32)})
    uneven = dict(truth, **{window: truth[window][:, :, 1:]})
    # A well-formed prefix of 8 tokens, under mlx-vlm's 16-token checkpoint minimum.
    from hetero_mlx import dsv4

    small = {
        name: mx.zeros([8 if d == -1 else d for d in shape], dtype=truth[name].dtype)
        for name, shape in dsv4.array_shapes(desc, 8, 8).items()
    }
    tok, mount, other = "/hetero/tokenize", "/hetero/mount", "0" * 32
    model = server["model"]
    return [
        ("tokenize malformed json", tok, b'{"messages": ', 400, "bad_json"),
        ("tokenize completions prompt", tok, {"model": model, "prompt": "hi"}, 400,
         "unsupported_endpoint"),
        ("tokenize empty messages", tok, {"model": model, "messages": []}, 400, "bad_messages"),
        ("tokenize no prompt", tok, {"model": model, "max_tokens": 4}, 400, "missing_prompt"),
        ("tokenize another model", tok, chat_body(server, "hi", model="other/model"), 404,
         "model_not_served"),
        ("tokenize without model", tok, {"messages": [{"role": "user", "content": "hi"}]}, 422,
         "rejected_by_server"),
        ("tokenize bad temperature", tok, chat_body(server, "hi", temperature="hot"), 422,
         "rejected_by_server"),
        ("tokenize no room to answer", tok, chat_body(server, "hi", max_tokens=0), 400,
         "rejected_by_server"),
        ("mount malformed json", mount, b"{not json", 400, "bad_json"),
        ("mount body not object", mount, b"[1, 2]", 400, "bad_json"),
        ("mount ids not a list", mount, {"entry": entry("e0"), "ids": "1 2"}, 400, "bad_ids"),
        ("mount ids out of vocab", mount,
         {"entry": entry("e1"), "ids": ids[:-1] + [desc["vocab_size"] + 7]}, 400,
         "ids_out_of_vocab"),
        ("mount fingerprint mismatch", mount, {"entry": entry("e2", fingerprint=other),
                                               "ids": ids}, 409, "fingerprint_mismatch"),
        ("mount family mismatch", mount, {"entry": entry("e3", family="llama"), "ids": ids}, 409,
         "family_mismatch"),
        ("mount B == len(ids)", mount,
         {"entry": entry("e4", B=len(ids), T=len(ids), ids=ids), "ids": ids}, 400,
         "prefix_too_long"),
        ("mount B under APC's minimum", mount,
         {"entry": write_entry(server, "e5", ids, 8, small, 8), "ids": ids}, 400,
         "prefix_too_short"),
        ("mount pooled rows short", mount, {"entry": with_arrays("e6", short_pool), "ids": ids},
         409, "layout_mismatch"),
        ("mount wrong dtype", mount, {"entry": with_arrays("e7", as_f32), "ids": ids}, 409,
         "dtype_mismatch"),
        ("mount missing array", mount, {"entry": with_arrays("e8", missing), "ids": ids}, 400,
         "missing_array"),
        ("mount unexpected array", mount, {"entry": with_arrays("e9", extra), "ids": ids}, 400,
         "unexpected_array"),
        ("mount no window_idx", mount, {"entry": entry("e10", window_idx=None), "ids": ids}, 400,
         "bad_entry"),
        ("mount window_idx past rows", mount,
         {"entry": entry("e11", window_idx=rows + 1), "ids": ids}, 409, "layout_mismatch"),
        ("mount window rows differ", mount, {"entry": with_arrays("e12", uneven), "ids": ids},
         409, "layout_mismatch"),
        ("mount entry ids differ", mount, {"entry": entry("e13", ids=[ids[1]] * n), "ids": ids},
         409, "ids_mismatch"),
        ("mount wrong layer count", mount,
         {"entry": entry("e14", layers=desc["layers"] + 1), "ids": ids}, 409, "layout_mismatch"),
        ("mount entry outside store", mount, {"entry": "/tmp", "ids": ids}, 400,
         "entry_outside_store"),
        ("mount no such entry", mount, {"entry": "absent", "ids": ids}, 400, "bad_entry"),
        ("cache of uncached prefix", "/hetero/cache",
         {"ids": [ids[1]] * 40, "B": 33, "out": "never.safetensors"}, 404, "not_cached"),
        ("cache bad B", "/hetero/cache", {"ids": ids, "B": 0, "out": "x.safetensors"}, 400,
         "bad_prefix_length"),
        ("cached_prefix empty ids", "/hetero/cached_prefix", {"ids": []}, 400, "bad_ids"),
        ("unknown seam path", "/hetero/nope", {}, 404, "not_found"),
    ]


def test_bad_inputs_get_json_errors_and_change_nothing(server):
    body = chat_body(server, SHORT)
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    ok(server, "/hetero/clear")
    complete(server, body)
    n = held_checkpoints(server, ids)[0]
    truth, window_idx = dump(server, ids, n, "bad-inputs-truth.safetensors")
    cached = ok(server, "/hetero/cached_prefix", {"ids": ids})
    stats = info(server)["prompt_cache"]
    assert cached["cached_tokens"] == len(ids) - 1

    for name, path, case, status, code in _bad_cases(server, ids, n, truth, window_idx):
        raw = case if isinstance(case, bytes) else None
        got_status, reply = post(server, path, case, raw=raw)
        assert (got_status, reply["error"]["code"]) == (status, code), (name, reply)
        assert reply["error"]["message"], name
        assert ok(server, "/hetero/cached_prefix", {"ids": ids}) == cached, name
        assert info(server)["prompt_cache"] == stats, name

    r = get(server, "/hetero/mount", timeout=5)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
    reply = complete(server, body)
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1
    assert get(server, "/health", timeout=5).json()["status"] == "healthy"


# ---- access: the secret, JSON bodies, CORS, the dump directory, the served model -----------


def _state(server, ids):
    """What a refused call must leave as it was: the reuse for ids, APC's entries, dumps."""
    dumps = sorted(p.name for p in (server["store"] / "dumps").iterdir())
    return ok(server, "/hetero/cached_prefix", {"ids": ids}), info(server)["prompt_cache"], dumps


def _warm(server):
    body = chat_body(server, SHORT)
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    ok(server, "/hetero/clear")
    complete(server, body)
    return ids, len(ids) - 1


def _cors_headers(r):
    return [h for h in r.headers if h.lower().startswith("access-control-")]


def test_every_seam_endpoint_needs_a_signature(server):
    ids, n = _warm(server)
    before = _state(server, ids)
    assert before[0]["cached_tokens"] == n
    calls = [
        ("GET", "/hetero/info", None),
        ("POST", "/hetero/tokenize", chat_body(server, "hi")),
        ("POST", "/hetero/cached_prefix", {"ids": ids}),
        ("POST", "/hetero/mount", {"entry": "absent", "ids": ids}),
        ("POST", "/hetero/unpin", {"pin": "anything"}),
        ("POST", "/hetero/cache", {"ids": ids, "B": n, "out": "stolen.safetensors"}),
        ("POST", "/hetero/clear", {}),
        ("POST", "/hetero/fault", {"kind": "evict"}),
        ("POST", "/hetero/nope", {}),
    ]
    # mlx-vlm's own paths too.
    calls += [("GET", "/health", None), ("GET", "/v1/models", None),
              ("POST", "/v1/chat/completions", chat_body(server, "hi"))]
    for method, path, body in calls:
        data = json.dumps(body).encode() if body is not None else b""
        wrong = signed_headers("0" * 64, method, path, data)["Authorization"]
        for name, header, code in (("none", None, "unauthorized"),
                                   ("bearer", f"Bearer {server['secret']}", "unauthorized"),
                                   ("wrong secret", wrong, "bad_signature")):
            headers = {"Content-Type": "application/json"}
            if header is not None:
                headers["Authorization"] = header
            r = requests.request(method, server["url"] + path, data=data, headers=headers,
                                 timeout=30)
            assert r.status_code == 401, (path, name, r.text)
            assert r.json()["error"]["code"] == code, (path, name)
            assert r.headers.get("WWW-Authenticate") == "Hetero-HMAC-SHA256", (path, name)
    assert _state(server, ids) == before
    assert not (server["store"] / "dumps" / "stolen.safetensors").exists()


def test_seam_posts_must_be_json(server):
    ids, _ = _warm(server)
    before = _state(server, ids)
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        for path in ("/hetero/clear", "/hetero/cached_prefix"):
            data = json.dumps({"ids": ids}).encode()
            headers = signed(server, "POST", path, data)
            if content_type:
                headers["Content-Type"] = content_type
            r = requests.post(server["url"] + path, data=data, headers=headers, timeout=30)
            assert r.status_code == 415, (content_type, path, r.text)
            assert r.json()["error"]["code"] == "unsupported_media_type"
    assert _state(server, ids) == before


def test_seam_approves_no_cross_origin_request(server):
    origin = {"Origin": "http://evil.example"}
    preflight = {**origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type, authorization"}
    # A browser's preflight carries no signature: refused everywhere, mlx-vlm's paths too.
    for path in ("/v1/chat/completions", "/hetero/clear", "/hetero/info"):
        r = requests.options(server["url"] + path, headers=preflight, timeout=10)
        assert r.status_code == 401 and not _cors_headers(r), (path, r.text)
    # Signed, mlx-vlm's own paths approve any origin (its CORSMiddleware); the seam's never do.
    r = requests.options(server["url"] + "/v1/chat/completions", timeout=10,
                         headers={**preflight, **signed(server, "OPTIONS", "/v1/chat/completions")})
    assert r.status_code == 200 and "access-control-allow-origin" in r.headers
    for path in ("/hetero/clear", "/hetero/info", "/hetero/nope"):
        r = requests.options(server["url"] + path, timeout=10,
                             headers={**preflight, **signed(server, "OPTIONS", path)})
        assert r.status_code == 405, (path, r.text)
        assert r.json()["error"]["code"] == "method_not_allowed"
        assert not _cors_headers(r), path
    for method, path, body in (("GET", "/hetero/info", None), ("POST", "/hetero/clear", {}),
                               ("POST", "/hetero/nope", {})):
        r = requests.request(method, server["url"] + path, json=body, headers=origin, timeout=30)
        assert r.status_code == 401 and not _cors_headers(r), path
        r = request(server, method, path, body, headers=origin)
        assert not _cors_headers(r), (path, r.headers)


def test_cache_dumps_only_into_its_dump_dir(server, tmp_path):
    ids, n = _warm(server)
    before = _state(server, ids)
    outside = tmp_path / "x.safetensors"
    for out in ("../x.safetensors", str(outside), "dumps/x.safetensors", "..", ".safetensors",
                "x.bin", "", None):
        status, reply = post(server, "/hetero/cache", {"ids": ids, "B": n, "out": out})
        assert (status, reply["error"]["code"]) == (400, "bad_out"), (out, reply)
    assert not outside.exists() and not (server["store"] / "x.safetensors").exists()
    assert _state(server, ids) == before
    arrays, _ = dump(server, ids, n, "inside.safetensors")
    assert "layers.0.window" in arrays


def test_decoder_serves_only_its_model(server):
    """Regression: mlx-vlm unloads its model for any request naming another one (or another
    adapter), and for /unload or a settings change; the seam refuses them all."""
    fingerprint = info(server)["fingerprint"]
    other = "someone/else"
    refused = [
        ("/v1/chat/completions", chat_body(server, "hi", model=other), 404, "model_not_served"),
        ("/chat/completions", chat_body(server, "hi", model=other), 404, "model_not_served"),
        ("/v1/chat/completions", chat_body(server, "hi", model=server["model"] + "/"), 404,
         "model_not_served"),
        ("/v1/chat/completions", chat_body(server, "hi", adapter_path="/tmp/adapter"), 400,
         "adapter_not_served"),
        ("/v1/responses", {"model": other, "input": "hi", "max_output_tokens": 4}, 404,
         "model_not_served"),
        ("/v1/embeddings", {"model": server["model"], "input": "hi"}, 404, "model_not_served"),
    ]
    for path, body, status, code in refused:
        got_status, reply = post(server, path, body)
        assert (got_status, reply["error"]["code"]) == (status, code), (path, body, reply)
        assert info(server)["fingerprint"] == fingerprint, path
    for method, path in (("POST", "/unload"), ("PATCH", "/v1/settings"), ("PATCH", "/settings")):
        r = request(server, method, path, {"max_tokens": 7})
        assert (r.status_code, r.json()["error"]["code"]) == (403, "refused_by_seam"), path
    reply = complete(server, chat_body(server, SHORT))
    assert reply["usage"]["prompt_tokens"] > 0
    assert info(server)["fingerprint"] == fingerprint
    health = get(server, "/health", timeout=5).json()
    assert health["loaded_model"] == server["model"]
