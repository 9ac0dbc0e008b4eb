"""Warm turns bridged by their tail, on real processes (frontstack.py).

A conversation grows turn by turn. The decoder's own conversation is the truth: each turn sent
to it directly, its prompt cache warm from the turns before. Then the same turns through the
front door, on a cold decoder: the first turn is bridged whole; from the second on, the decoder
already holds the conversation so far, and only the new tail is bridged: the prefill host
resumes from its own prefix cache (the state of the previous turn's prompt), computes and sends
only the tail's rows, and the seam mounts them onto the decoder's own cache. Every answer must
equal the decoder's own, every verdict be confirmed by the decoder's usage.

The tiny model's cache is 256 bytes a token (2 layers, K and V, 2 kv heads of 16, bf16).
"""

import json

import pytest
from frontstack import (MODEL_NAME, TINY, Decoder, answer, cached_tokens, post_front,
                        running_stack, text, verdict_of, warm_turn)

ROW_BYTES = 256  # the tiny model's cache per token
TURNS = 8
BLOCK = 256  # the prefill host's prefix-cache block (its default)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with running_stack(TINY, tmp_path_factory.mktemp("turns"), "tiny test model") as stack:
        yield stack


def turn_text(k: int) -> str:
    return text(f"turn-{k}", 150 + (k * 97) % 250)  # 150..400 words


def body_of(messages: list) -> dict:
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": 12, "temperature": 0.0}


def test_every_later_turn_bridges_only_its_tail_and_answers_as_the_decoder(tiny) -> None:
    decoder = Decoder(tiny.decoder.port)
    # The decoder's own conversation, warm as it goes.
    decoder.clear()
    native, messages = [], []
    for k in range(TURNS):
        messages.append({"role": "user", "content": turn_text(k)})
        reply = decoder.post("/v1/chat/completions", body_of(messages), timeout=600)
        native.append(answer(reply))
        messages.append({"role": "assistant", "content": native[-1]})

    # The same conversation through the front door, from a cold decoder.
    prefill = tiny.prefill(chunk=128)
    front = tiny.front(prefill.port)
    decoder.clear()
    messages, rows = [], []
    for k in range(TURNS):
        messages.append({"role": "user", "content": turn_text(k)})
        ids, held, r, v = warm_turn(decoder, front, body_of(messages))
        T, B = len(ids), len(ids) - 1
        rows.append({"turn": k + 1, "T": T, "held": held, "start": v.get("start", 0),
                     "computed": v.get("computed"), "bytes": v["bytes"], "verdict": v["verdict"]})
        print("turn", json.dumps(rows[-1]))
        assert v["verdict"] == "complete" and v["B"] == B, v
        assert v["confirmed"] and cached_tokens(r.json()) == B, v
        if k == 0:
            assert held == 0 and "start" not in v and v["computed"] == B, v
        else:
            # Only the tail: the rows from what the decoder held, computed from the prefill
            # host's cached state of the previous turn (whole blocks of it).
            assert held > 0 and v["start"] == held, (held, v)
            prev_b = rows[-2]["T"] - 1
            assert v["computed"] == B - (min(prev_b, held) // BLOCK) * BLOCK, (prev_b, v)
            assert v["bytes"] < ROW_BYTES * (B - held) + 64 * 1024, v  # tail rows + framing
        assert answer(r.json()) == native[k], (k, v)
        messages.append({"role": "assistant", "content": answer(r.json())})


def test_a_tail_whose_prefix_the_decoder_no_longer_holds_is_refused(tiny) -> None:
    import mlx.core as mx
    import requests

    decoder = Decoder(tiny.decoder.port)
    decoder.clear()
    ids = decoder.post("/hetero/tokenize", body_of([{"role": "user", "content": turn_text(99)}]))[
        "ids"]
    B, start = len(ids) - 1, 40
    entry = tiny.store / tiny.info["fingerprint"] / "hand-made-tail"
    entry.mkdir(parents=True)
    (entry / "entry.json").write_text(json.dumps({
        "format": "hetero-store-v1", "family": "llama", "fingerprint": tiny.info["fingerprint"],
        "B": B, "T": len(ids), "layers": 2, "ids": ids[:B], "start": start}))
    rows = mx.zeros((2, B - start, 16), dtype=mx.bfloat16)
    mx.save_safetensors(str(entry / "cache.safetensors"),
                        {f"layers.{i}.{k}": rows for i in range(2) for k in ("keys", "values")})
    r = requests.post(tiny.url(tiny.decoder.port, "/hetero/mount"),
                      json={"entry": str(entry), "ids": ids}, timeout=30)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "prefix_not_cached" and f"cache of {start} tokens" in err["message"], err
    assert decoder.cached(ids) == 0  # nothing was mounted


def test_once_both_costs_are_measured_the_route_follows_them(tiny) -> None:
    import requests

    prefill = tiny.prefill(chunk=128)
    front = tiny.front(prefill.port, **{"route-by": "rates"})
    decoder = Decoder(tiny.decoder.port)
    decoder.clear()
    # The decoder's cost: native streams (their first token times what they processed).
    for k in range(2):
        body = dict(body_of([{"role": "user", "content": text(f"rates-native-{k}", 200 + 150 * k)}]),
                    stream=True)
        r = requests.post(tiny.url(front.port, "/v1/chat/completions"), json=body, timeout=600,
                          headers={"X-PD-Bridge-Mode": "native"})
        assert r.status_code == 200 and "data: [DONE]" in r.text, r.text[-300:]
    # The bridge's cost: cold prompts, routed by the fixed minimum while unmeasured.
    for k in range(2):
        r = post_front(front, body_of([{"role": "user",
                                        "content": text(f"rates-bridge-{k}", 250 + 200 * k)}]))
        v = verdict_of(r.headers)
        assert v["verdict"] == "complete" and v["route"]["by"] == "min_tail", v
    # Now a warm turn: the measured costs decide, and the verdict carries them.
    messages = [{"role": "user", "content": text("rates-turn", 300)}]
    first = post_front(front, body_of(messages))
    messages += [{"role": "assistant", "content": answer(first.json())},
                 {"role": "user", "content": text("rates-turn-2", 120)}]
    r = post_front(front, body_of(messages))
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    route = v["route"]
    assert route["by"] == "rates" and route["tail"] > 0, v
    assert {"bridge_ms", "native_ms"} <= set(route), v
    bridged = route["bridge_ms"] < route["native_ms"]
    assert (v["verdict"] == "complete") == bridged, v
    if not bridged:
        assert v["verdict"].startswith("skipped: the decoder is faster"), v
    print("route", json.dumps(route), v["verdict"])
    # Either way the answer is the decoder's own.
    decoder.clear()
    native = decoder.post("/v1/chat/completions", body_of(messages[:1]), timeout=600)
    assert answer(native) == answer(first.json())
    native = decoder.post("/v1/chat/completions", body_of(messages), timeout=600)
    assert answer(native) == answer(r.json())
