"""The prefill calls the seam says the decoder will run a prompt in (POST /hetero/tokenize
"calls", schedule.py) are the calls its model gets.

The truth is the model itself: the decoder runs with `serve --test-faults`, whose recorder notes
the length of every call the model gets (POST /hetero/calls). A small --prefill-step-size makes
the tiny model's prompts several calls long. Each request asks for one token, so the calls after
the prediction's are decode steps only.
"""

import os
from pathlib import Path

import pytest
from seam_server import ok, seam_server

STEP = 48
STARTUP_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = os.environ.get("HETERO_TEST_MODEL")
    if not path or not (Path(path) / "config.json").exists():
        pytest.skip("HETERO_TEST_MODEL is not a model directory (e.g. from tiny-llama)")
    args = ["--test-faults", "--prefill-step-size", str(STEP)]
    with seam_server(path, tmp_path_factory, "/health", STARTUP_TIMEOUT_S,
                     extra_args=args) as srv:
        yield srv


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{k % 37}" for k in range(n))


def run(server, body: dict) -> dict:
    """Tokenize (the prediction), then run the request; returns the prediction with the calls
    the model got and the decoder's own count of cached tokens."""
    told = ok(server, "/hetero/tokenize", body)
    ok(server, "/hetero/calls")  # start from nothing recorded
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    reply = ok(server, path, dict(body, max_tokens=1, temperature=0.0))
    got = ok(server, "/hetero/calls")["calls"]
    return dict(told, got=got, usage_cached=reply["usage"]["prompt_tokens_details"][
        "cached_tokens"])


def check(r: dict) -> None:
    predicted = [n for _, n in r["calls"]]
    assert r["got"][: len(predicted)] == predicted, (r["calls"], r["got"])
    assert all(n == 1 for n in r["got"][len(predicted):]), r["got"]  # decode steps
    assert r["usage_cached"] == r["cached_tokens"]
    # The calls tile the prompt from what the cache holds to its last token.
    assert r["calls"][0][0] == r["cached_tokens"] and r["calls"][-1] == [r["n"] - 1, 1]
    assert all(a[0] + a[1] == b[0] for a, b in zip(r["calls"], r["calls"][1:]))


def test_a_cold_chat_with_a_system_message_is_cut_at_its_segments(server) -> None:
    ok(server, "/hetero/clear")
    body = {"messages": [{"role": "system", "content": words("s", 70)},
                         {"role": "user", "content": words("u", 120)}]}
    r = run(server, body)
    check(r)
    assert r["path"] == "batch" and r["cached_tokens"] == 0
    system = r["segments"][0]["n"]
    assert r["segments"][0]["type"] == "system" and system % STEP != 0
    # A call ends where the system segment does: calls do not cross segments.
    assert any(s + n == system for s, n in r["calls"])


def test_a_warm_turn_is_cut_from_what_the_cache_holds(server) -> None:
    ok(server, "/hetero/clear")
    first = {"messages": [{"role": "user", "content": words("a", 150)}]}
    check(run(server, first))
    second = {"messages": first["messages"] + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": words("b", 130)}]}
    r = run(server, second)
    check(r)
    assert r["cached_tokens"] > 0


def test_a_request_with_a_seed_takes_the_single_path(server) -> None:
    ok(server, "/hetero/clear")
    body = {"messages": [{"role": "system", "content": words("s", 70)},
                         {"role": "user", "content": words("u", 120)}], "seed": 3}
    r = run(server, body)
    check(r)
    assert r["path"] == "single"
    # One stream of steps from C, whatever the segments: every call but the last two is a step.
    assert all(n == STEP for _, n in r["calls"][:-2])


def test_a_plain_completion_is_one_segment(server) -> None:
    ok(server, "/hetero/clear")
    r = run(server, {"prompt": words("p", 200)})
    check(r)
    assert [n for _, n in r["calls"][:-2]] == [STEP] * (len(r["calls"]) - 2)


def test_the_recorder_is_off_without_test_faults(tmp_path_factory) -> None:
    path = os.environ.get("HETERO_TEST_MODEL")
    if not path or not (Path(path) / "config.json").exists():
        pytest.skip("HETERO_TEST_MODEL is not a model directory (e.g. from tiny-llama)")
    from seam_server import post
    with seam_server(path, tmp_path_factory, "/health", STARTUP_TIMEOUT_S) as plain:
        status, reply = post(plain, "/hetero/calls")
        assert status == 404 and reply["error"]["code"] == "not_found"
