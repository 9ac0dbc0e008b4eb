"""End-to-end tests of the decoder seam (python/hetero_mlx) against the real mlx-lm server.

Starts `python -m hetero_mlx serve` on a free port with the model in HETERO_TEST_MODEL (a tiny
random llama from `python -m hetero_mlx tiny-llama`, or SmolLM2-135M-Instruct) and talks HTTP
to it: tokenization equals what the server processes, a mounted cache is reused as an ordinary
prefix hit and gives the native answer, and every bad input gets a 4xx JSON error while the
server keeps serving with its prompt cache untouched.
"""

import json
import os
from pathlib import Path

import pytest
from seam_server import info, ok, post, seam_server

mx = pytest.importorskip("mlx.core")
requests = pytest.importorskip("requests")

REPO = Path(__file__).resolve().parents[2]
STORE_FORMAT = "hetero-store-v1"
STARTUP_TIMEOUT_S = 120
PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3
MESSAGES = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "Why is the sky blue? Explain it like I am five years old."},
]


# ---- server process ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir() -> str:
    path = os.environ.get("HETERO_TEST_MODEL")
    if not path:
        pytest.skip("HETERO_TEST_MODEL is not set (a model directory, e.g. from tiny-llama)")
    if not (Path(path) / "config.json").exists():
        pytest.skip(f"HETERO_TEST_MODEL={path} has no config.json")
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with seam_server(model_dir, tmp_path_factory, "/health", STARTUP_TIMEOUT_S) as srv:
        yield srv


# ---- HTTP helpers --------------------------------------------------------------------------


def complete(server, body):
    """A native completion (chat when the body has messages); returns the reply JSON."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return ok(server, path, body)


def answer_of(reply):
    choice = reply["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, [t["id"] for t in choice["logprobs"]["content"]]


def write_entry(server, name, prompt_ids, n, arrays, **override):
    """A decoder-store entry as the C++ front writes it; `override` replaces entry.json keys."""
    desc = info(server)
    path = server["store"] / name
    path.mkdir()
    meta = {"format": STORE_FORMAT, "family": "llama", "fingerprint": desc["fingerprint"]}
    meta.update(B=n, T=len(prompt_ids), layers=desc["layers"], ids=prompt_ids[:n])
    meta.update(override)
    (path / "entry.json").write_text(json.dumps(meta))
    mx.save_safetensors(str(path / "cache.safetensors"), arrays)
    return str(path)


def random_arrays(desc, n, dtype=None, shape=None):
    shape = shape or (desc["kv_heads"], n, desc["head_dim"])
    dtype = dtype or mx.bfloat16
    names = [f"layers.{i}.{k}" for i in range(desc["layers"]) for k in ("keys", "values")]
    return {name: mx.random.normal(shape).astype(dtype) for name in names}


# ---- tokenize ------------------------------------------------------------------------------


def test_info_describes_the_loaded_model(server):
    desc = info(server)
    assert desc["family"] == "llama"
    assert len(desc["fingerprint"]) == 32 and int(desc["fingerprint"], 16) >= 0
    assert desc["layers"] > 0 and desc["kv_heads"] > 0 and desc["head_dim"] > 0
    assert desc["prefill_step_size"] == 2048  # mlx-lm's own default survives
    assert set(desc["versions"]) == {"mlx", "mlx_lm"}
    assert desc["quantization"] is None  # a bf16 model; quantized ones: test_pairing.py


def test_tokenize_completion_is_what_the_server_processes(server):
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    tokens = ok(server, "/hetero/tokenize", body)
    assert tokens["n"] == len(tokens["ids"]) > 0
    assert complete(server, body)["usage"]["prompt_tokens"] == tokens["n"]


def test_tokenize_chat_applies_the_chat_template(server, model_dir):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        pytest.skip("test model has no chat template")
    body = {"messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    tokens = ok(server, "/hetero/tokenize", body)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(tokens["ids"]) == text
    assert sum(s["n"] for s in tokens["segments"]) == tokens["n"]
    assert complete(server, body)["usage"]["prompt_tokens"] == tokens["n"]


def test_cached_prefix_matches_the_servers_reuse(server):
    body = {"prompt": PROMPT + "Again.", "max_tokens": 2, "temperature": 0}
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    complete(server, body)
    cached = ok(server, "/hetero/cached_prefix", {"ids": ids})["cached_tokens"]
    assert 0 < cached < len(ids)
    assert complete(server, body)["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


# ---- mount ---------------------------------------------------------------------------------


def mount_native_prefix(server, body, tmp_path, name):
    """Runs `body` natively, mounts the server's own rows for all but its last 3 prompt tokens
    from a store entry after clearing the cache; returns (ids, B, truth file, native answer)."""
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    n = len(ids) - 3
    ok(server, "/hetero/clear")
    native = answer_of(complete(server, body))
    truth = str(tmp_path / "truth.safetensors")
    assert ok(server, "/hetero/cache", {"ids": ids, "B": n, "out": truth})["B"] == n
    entry = write_entry(server, name, ids, n, mx.load(truth))

    ok(server, "/hetero/clear")
    assert ok(server, "/hetero/cached_prefix", {"ids": ids})["cached_tokens"] == 0
    mounted = ok(server, "/hetero/mount", {"entry": entry, "ids": ids})
    assert mounted["mounted"] == n and isinstance(mounted["pin"], str) and mounted["pin"]
    assert ok(server, "/hetero/cached_prefix", {"ids": ids})["cached_tokens"] == n
    return ids, n, truth, native


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_mount_is_reused_and_answers_as_native(server, kind, tmp_path):
    body = {"max_tokens": 8, "temperature": 0, "logprobs": True}
    body.update({"messages": MESSAGES} if kind == "chat" else {"prompt": PROMPT})
    ids, n, truth, native = mount_native_prefix(server, body, tmp_path, f"mount-{kind}")

    # The mounted objects hold exactly the arrays mounted (bit-exact: nothing is computed).
    again = str(tmp_path / "again.safetensors")
    ok(server, "/hetero/cache", {"ids": ids, "B": n, "out": again})
    expected, got = mx.load(truth), mx.load(again)
    assert sorted(got) == sorted(expected)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert mx.array_equal(got[name], array).item(), name

    reply = complete(server, body)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    assert answer_of(reply) == native


def test_openai_client_sees_the_mounted_prefix(server, tmp_path):
    openai = pytest.importorskip("openai")
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "logprobs": True}
    ids, n, _, native = mount_native_prefix(server, body, tmp_path, "mount-openai")
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused")
    reply = client.chat.completions.create(model="default_model", **body)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.prompt_tokens_details.cached_tokens == n
    assert reply.choices[0].message.content == native[0]


# ---- bad inputs ----------------------------------------------------------------------------


def _bad_cases(server):
    """(name, path, body or raw bytes, status, code) for every rejected input."""
    desc = info(server)
    ids = ok(server, "/hetero/tokenize", {"prompt": PROMPT})["ids"]
    n = len(ids) - 2
    good = random_arrays(desc, n)
    entry = lambda name, **kw: write_entry(server, name, ids, n, good, **kw)  # noqa: E731
    missing = {k: v for k, v in good.items() if k != "layers.0.values"}
    other = "0" * 32
    mount = "/hetero/mount"
    return [
        ("tokenize malformed json", "/hetero/tokenize", b'{"prompt": ', 400, "bad_json"),
        ("tokenize empty prompt", "/hetero/tokenize", {"prompt": ""}, 400, "bad_prompt"),
        ("tokenize prompt not text", "/hetero/tokenize", {"prompt": [1, 2]}, 400, "bad_prompt"),
        ("tokenize empty messages", "/hetero/tokenize", {"messages": []}, 400, "bad_messages"),
        ("tokenize no prompt", "/hetero/tokenize", {"max_tokens": 4}, 400, "missing_prompt"),
        ("tokenize bad max_tokens", "/hetero/tokenize", {"prompt": "x", "max_tokens": 0}, 400,
         "rejected_by_server"),
        ("mount malformed json", mount, b"{not json", 400, "bad_json"),
        ("mount body not object", mount, b"[1, 2]", 400, "bad_json"),
        ("mount ids not a list", mount, {"entry": entry("e0"), "ids": "1 2"}, 400, "bad_ids"),
        ("mount ids out of vocab", mount,
         {"entry": entry("e1"), "ids": ids[:-1] + [desc["vocab_size"] + 7]}, 400,
         "ids_out_of_vocab"),
        ("mount fingerprint mismatch", mount, {"entry": entry("e2", fingerprint=other), "ids": ids},
         409, "fingerprint_mismatch"),
        ("mount B == len(ids)", mount,
         {"entry": write_entry(server, "e3", ids, len(ids), random_arrays(desc, len(ids))),
          "ids": ids}, 400, "prefix_too_long"),
        ("mount wrong shape", mount,
         {"entry": write_entry(server, "e4", ids, n, random_arrays(desc, n, shape=(1, n, 8))),
          "ids": ids}, 409, "layout_mismatch"),
        ("mount wrong dtype", mount,
         {"entry": write_entry(server, "e5", ids, n, random_arrays(desc, n, dtype=mx.float32)),
          "ids": ids}, 409, "dtype_mismatch"),
        ("mount missing array", mount,
         {"entry": write_entry(server, "e6", ids, n, missing), "ids": ids}, 400, "missing_array"),
        ("mount entry ids differ", mount, {"entry": entry("e7", ids=[ids[1]] * n), "ids": ids},
         409, "ids_mismatch"),
        ("mount wrong layer count", mount, {"entry": entry("e8", layers=desc["layers"] + 1),
                                            "ids": ids}, 409, "layout_mismatch"),
        ("mount entry outside store", mount, {"entry": "/tmp", "ids": ids}, 400,
         "entry_outside_store"),
        ("mount no such entry", mount, {"entry": "absent", "ids": ids}, 400, "bad_entry"),
        ("cache of uncached prefix", "/hetero/cache",
         {"ids": [ids[1]] * 6, "B": 5, "out": "/tmp/never.safetensors"}, 404, "not_cached"),
        ("cached_prefix empty ids", "/hetero/cached_prefix", {"ids": []}, 400, "bad_ids"),
        ("unknown seam path", "/hetero/nope", {}, 404, "not_found"),
    ]


def test_bad_inputs_get_json_errors_and_change_nothing(server):
    ids = ok(server, "/hetero/tokenize", {"prompt": PROMPT})["ids"]
    complete(server, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    cached = ok(server, "/hetero/cached_prefix", {"ids": ids})
    stats = info(server)["prompt_cache"]
    assert cached["cached_tokens"] > 0

    for name, path, body, status, code in _bad_cases(server):
        raw = body if isinstance(body, bytes) else None
        got_status, reply = post(server, path, body, raw=raw)
        assert (got_status, reply["error"]["code"]) == (status, code), (name, reply)
        assert reply["error"]["message"], name
        assert ok(server, "/hetero/cached_prefix", {"ids": ids}) == cached, name
        assert info(server)["prompt_cache"] == stats, name

    reply = complete(server, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert requests.get(server["url"] + "/health", timeout=5).json() == {"status": "ok"}


def test_fingerprint_mismatch_names_both_values(server):
    desc = info(server)
    ids = ok(server, "/hetero/tokenize", {"prompt": PROMPT})["ids"]
    n = len(ids) - 1
    entry = write_entry(server, "fp", ids, n, random_arrays(desc, n), fingerprint="f" * 32)
    status, reply = post(server, "/hetero/mount", {"entry": entry, "ids": ids})
    assert status == 409
    assert "f" * 32 in reply["error"]["message"]
    assert desc["fingerprint"] in reply["error"]["message"]
