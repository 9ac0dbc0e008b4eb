"""Verdicts the decoder confirms, on real processes (frontstack.py).

A stream's X-PD-Bridge header leaves before the decoder runs, so it is a prediction
("confirmed": false). The front asks the decoder for usage in every stream and, at its end,
confirms the verdict with the decoder's own cached_tokens: /metrics and the log count the
confirmed one, and a client that asked for usage gets it in the usage event ("x_pd_bridge").
A non-streaming reply's header is the confirmed verdict.

The decoder seam runs with --test-faults: POST /hetero/fault arms a one-shot eviction right
before the decoder's next lookup, either with the pin kept ("evict": the pin must put the
mounted entry back) or with it dropped ("drop-mount": the decoder re-prefills, and the verdict
must say so).
"""

import json
from typing import List, Tuple

import pytest
from frontstack import (CHUNK, MIN_TOKENS, TINY, Proc, Stack, answer, cached_tokens, chat, metrics,
                        post_front, requests, running_stack, text, verdict_of, wait_cached)

KIND = 'hetero_requests_total{verdict="%s"}'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with running_stack(TINY, tmp_path_factory.mktemp("verdicts"), "tiny test model") as stack:
        yield stack


@pytest.fixture(scope="module")
def front(tiny) -> Proc:
    return tiny.front(tiny.prefill(chunk=64).port)


def stream(front: Proc, body: dict) -> Tuple[dict, List[dict], str]:
    """(header verdict, every data event's JSON, the text) of a streamed request."""
    r = requests.post(Stack.url(front.port, "/v1/chat/completions"),
                      json=dict(body, stream=True), stream=True, timeout=600)
    assert r.status_code == 200, r.text
    header = verdict_of(r.headers)
    raw = r.content.decode()
    events = [json.loads(line[5:]) for line in raw.split("\n")
              if line.startswith("data:") and line.strip() != "data: [DONE]"]
    assert raw.rstrip().endswith("data: [DONE]"), raw[-300:]
    content = "".join((e["choices"][0].get("delta", {}).get("content") or "")
                      for e in events if e.get("choices"))
    return header, events, content


def usage_event(events: List[dict]) -> dict:
    found = [e for e in events if isinstance(e.get("usage"), dict) and not e.get("choices")]
    assert len(found) == 1, events[-3:]
    return found[0]


def arm(tiny, kind: str) -> None:
    r = requests.post(Stack.url(tiny.decoder.port, "/hetero/fault"), json={"kind": kind},
                      timeout=10)
    assert r.status_code == 200, r.text


def delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


def test_stream_verdict_is_confirmed_in_the_usage_event(tiny, front) -> None:
    body = chat(text("confirm-stream", 120), max_tokens=12)
    native = tiny.native(body)
    T = native["usage"]["prompt_tokens"]
    before = metrics(front)
    header, events, content = stream(front, dict(body, stream_options={"include_usage": True}))
    assert header["verdict"] == "complete" and header["confirmed"] is False, header
    ev = usage_event(events)
    assert ev["usage"]["prompt_tokens_details"]["cached_tokens"] == T - 1
    v = ev["x_pd_bridge"]
    assert v["verdict"] == "complete" and v["confirmed"] is True and v["reused"] == T - 1, v
    assert (v["B"], v["T"]) == (T - 1, T)
    assert content == answer(native)
    after = metrics(front)
    assert delta(before, after, KIND % "complete") == 1
    assert delta(before, after, "hetero_bridged_tokens_total") == T - 1


def test_stream_without_usage_request_gets_none_and_is_still_confirmed(tiny, front) -> None:
    # The front asked the decoder for usage; a client that did not ask never sees it.
    body = chat(text("confirm-stream-no-usage", 120), max_tokens=12)
    native = tiny.native(body)
    before = metrics(front)
    header, events, content = stream(front, body)
    assert header["verdict"] == "complete", header
    assert not [e for e in events if e.get("usage")], events[-2:]
    assert content == answer(native)
    assert delta(before, metrics(front), KIND % "complete") == 1


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "stream"])
def test_mount_evicted_before_lookup_comes_back_through_its_pin(tiny, front, streamed) -> None:
    body = chat(text(f"pin-evict-{streamed}", 120), max_tokens=8)
    native = tiny.native(body)
    T = native["usage"]["prompt_tokens"]
    arm(tiny, "evict")
    if streamed:
        _, events, content = stream(front, dict(body, stream_options={"include_usage": True}))
        v, reused = usage_event(events)["x_pd_bridge"], T - 1
    else:
        r = post_front(front, body)
        v, content, reused = verdict_of(r.headers), answer(r.json()), cached_tokens(r.json())
    assert v["verdict"] == "complete" and v["confirmed"] and v["reused"] == T - 1, v
    assert reused == T - 1
    assert content == answer(native)


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "stream"])
def test_mount_lost_before_lookup_is_confirmed_as_reprefilled(tiny, front, streamed) -> None:
    body = chat(text(f"pin-drop-{streamed}", 120), max_tokens=8)
    native = tiny.native(body)
    T = native["usage"]["prompt_tokens"]
    before = metrics(front)
    arm(tiny, "drop-mount")
    if streamed:
        header, events, content = stream(front, dict(body, stream_options={"include_usage": True}))
        assert header["verdict"] == "complete" and not header["confirmed"], header  # predicted
        ev = usage_event(events)
        v, reused = ev["x_pd_bridge"], ev["usage"]["prompt_tokens_details"]["cached_tokens"]
    else:
        r = post_front(front, body)
        v, content, reused = verdict_of(r.headers), answer(r.json()), cached_tokens(r.json())
    assert reused == 0
    assert v["verdict"] == f"declined: the decoder re-prefilled: it reused 0 of the {T - 1} " \
                           "mounted tokens", v
    assert v["confirmed"] and v["reused"] == 0 and v["B"] == 0, v
    assert content == answer(native)
    after = metrics(front)
    assert delta(before, after, KIND % "declined") == 1
    assert delta(before, after, KIND % "complete") == 0
    assert delta(before, after, "hetero_bridged_tokens_total") == 0


def test_partial_no_longer_than_the_decoders_own_prefix_is_not_mounted(tiny) -> None:
    # The decoder already holds C tokens of the prompt; a broken whole-prefix stream (tails
    # off) verified fewer rows. Mounting them would change nothing: the verdict is declined, and
    # it reports the C rows the decoder reused of its own. With tails (the default) the same
    # break leaves a tail from C: mounted onto the decoder's own rows, a partial beyond C.
    corrupt = tiny.front(tiny.prefill("corrupt:1").port,
                         **{"partial-min-fraction": 0.05, "bridge-tails": "off"})
    first = {"model": "default_model", "prompt": text("own-prefix", 60), "max_tokens": 1,
             "temperature": 0.0}
    first_ids = requests.post(Stack.url(tiny.decoder.port, "/hetero/tokenize"), json=first,
                              timeout=60).json()["ids"]
    tiny.clear()
    r = requests.post(Stack.url(tiny.decoder.port, "/v1/completions"), json=first, timeout=120)
    assert r.status_code == 200, r.text
    wait_cached(tiny.cached, first_ids)  # its last entry goes in after the reply
    longer = dict(first, prompt=first["prompt"] + " " + text("own-prefix-tail", 120),
                  max_tokens=8)
    ids = requests.post(Stack.url(tiny.decoder.port, "/hetero/tokenize"), json=longer,
                        timeout=60).json()["ids"]
    own = tiny.cached(ids)
    assert CHUNK < own and len(ids) - own >= MIN_TOKENS, (own, len(ids))
    r = post_front(corrupt, longer, "/v1/completions")
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    assert v["verdict"].startswith("declined: ") and f"already holds {own}" in v["verdict"], v
    assert v["confirmed"] and v["reused"] == own == cached_tokens(r.json()), v
    # The decoder stores this request's entry after its reply: a clear before that store would
    # leave it behind (the first request below then finds 203 rows, not its own 66).
    wait_cached(tiny.cached, ids)
    tiny.clear()

    with_tails = tiny.front(tiny.prefill("corrupt:1").port, **{"partial-min-fraction": 0.05})
    r = requests.post(Stack.url(tiny.decoder.port, "/v1/completions"), json=first, timeout=120)
    assert r.status_code == 200, r.text
    wait_cached(tiny.cached, first_ids)
    assert tiny.cached(ids) == own
    r = post_front(with_tails, longer, "/v1/completions")
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    # Segment 0 of the tail ([own, own + CHUNK)) verified; segment 1 was corrupt.
    assert v["verdict"] == f"partial {own + CHUNK}/{len(ids)}" and v["start"] == own, v
    assert v["confirmed"] and cached_tokens(r.json()) == own + CHUNK, v
    tiny.clear()
