"""Unit tests of the seam's hardening that need no server: request signatures (auth.md), the
secret file, the completion-body checks, body and JSON bounds, and the tenants' partitions of
the prompt cache (issue 50). The same mechanisms on a real server: test_seam_hardening.py."""

import threading
from email.message import Message

import pytest

from hetero_mlx import access, bounds, checks, tenants
from hetero_mlx.errors import SeamError

SECRET = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
# The fixed vector (auth.md); the C++ signer (src/common) must give the same hex.
VECTOR = dict(method="POST", target="/hetero/tokenize", body=b'{"ids":[1,2,3]}', t=1700000000,
              n="0123456789abcdef0123456789abcdef")
VECTOR_S = "086f761d1b634dd0cdead66edfc75caf08f9faf8e54736c85d6d0036b10ba4af"


def code_of(call):
    with pytest.raises(SeamError) as e:
        call()
    return e.value.status, e.value.code


# ---- signatures ------------------------------------------------------------------------------


def test_signature_matches_the_fixed_vector():
    headers = access.signed_headers(SECRET, **VECTOR)
    assert headers == {"Authorization": "Hetero-HMAC-SHA256 t=1700000000, "
                                        f"n={VECTOR['n']}, s={VECTOR_S}"}
    # K_req, not the secret, keys the signature.
    assert access.request_key(SECRET).hex() != SECRET


def test_checks_come_in_auth_md_order():
    now = [1700000000.0]
    auth = access.RequestAuth(SECRET, clock=lambda: now[0])
    header = access.signed_headers(SECRET, **VECTOR)["Authorization"]
    creds = auth.check_header(header)
    assert (creds.t, creds.n, creds.s) == (VECTOR["t"], VECTOR["n"], VECTOR_S)
    # Spaces before a field are allowed, as by the C++ verifier.
    assert auth.check_header(header.replace(", ", ",").replace(" t=", "  t=")) == creds
    # Malformed: the header alone decides, before any body.
    for bad in (None, "", "Bearer " + SECRET, header.replace(", ", " ,"), header.upper(),
                header + " ", header.replace("s=", "s=0"), header.replace("t=", "t=-"),
                header.replace("HMAC-SHA256 ", "HMAC-SHA256"), "x" + header):
        assert code_of(lambda: auth.check_header(bad)) == (401, "unauthorized"), bad
    # Clock skew: 300 s either way is fine, 301 is not, and the reply says the server's time.
    for skew in (-300, 300):
        now[0] = VECTOR["t"] + skew
        auth.check_header(header)
    now[0] = VECTOR["t"] + 301
    with pytest.raises(SeamError) as e:
        auth.check_header(header)
    assert (e.value.status, e.value.code) == (401, "clock_skew")
    assert e.value.headers["X-Hetero-Time"] == str(VECTOR["t"] + 301)
    now[0] = VECTOR["t"]
    # Signature over method, target and body.
    for change in ({"method": "GET"}, {"target": "/hetero/tokenize?x"}, {"body": b"{}"}):
        args = dict(VECTOR, **change)
        assert code_of(lambda: auth.check_body(creds, args["method"], args["target"],
                                               args["body"])) == (401, "bad_signature"), change
    # A failed signature is not remembered: the right one is still accepted, once.
    auth.check_body(creds, VECTOR["method"], VECTOR["target"], VECTOR["body"])
    assert code_of(lambda: auth.check_body(creds, VECTOR["method"], VECTOR["target"],
                                           VECTOR["body"])) == (401, "replayed")


def test_nonce_memory_expires_and_refuses_when_full():
    now = [0.0]
    nonces = access.NonceMemory(ttl_s=600, capacity=3, clock=lambda: now[0])
    for n in ("a", "b", "c"):
        nonces.remember(n)
    assert code_of(lambda: nonces.remember("a")) == (401, "replayed")
    # Full of unexpired nonces: busy, and nothing forgotten early.
    assert code_of(lambda: nonces.remember("d")) == (503, "busy")
    now[0] = 599.0
    assert code_of(lambda: nonces.remember("d")) == (503, "busy")
    now[0] = 600.0  # a, b and c expire
    nonces.remember("d")
    nonces.remember("a")
    assert len(nonces) == 2


def test_nonce_memory_defaults_are_auth_md_bounds():
    nonces = access.NonceMemory()
    assert (nonces._ttl_s, nonces._capacity) == (600.0, 262_144)


# ---- the secret file -------------------------------------------------------------------------


def test_read_secret_refuses_short_or_exposed_files(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    assert access.read_secret(path) == SECRET
    for mode in (0o640, 0o604, 0o620, 0o602, 0o644, 0o666, 0o610):
        path.chmod(mode)
        with pytest.raises(SystemExit) as e:
            access.read_secret(path)
        assert f"{mode:04o}" in str(e.value) and "chmod 600" in str(e.value), mode
    path.chmod(0o600)
    path.write_text("x" * 31)
    with pytest.raises(SystemExit) as e:
        access.read_secret(path)
    assert "31 characters" in str(e.value) and "at least 32" in str(e.value)
    path.write_text("x" * 32)
    assert access.read_secret(path) == "x" * 32


# ---- completion bodies that kill mlx-lm's generation thread --------------------------------

VOCAB = 49152
GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("extra, code", [
    # Each of these killed the generation thread of mlx-lm 0.32.2 (or its process), found by
    # scripts/explore_decoder_killers.py; regression tests for issue 50, finding "killers".
    ({"stop": 5}, "bad_stop"), ({"stop": [1]}, "bad_stop"), ({"stop": [["x"]]}, "bad_stop"),
    ({"stop": [{}]}, "bad_stop"), ({"stop": [None]}, "bad_stop"), ({"stop": True}, "bad_stop"),
    ({"logit_bias": {str(2**70): 1}}, "bad_logit_bias"),
    ({"logit_bias": {str(2**40): 1}}, "bad_logit_bias"),
    ({"logit_bias": {str(VOCAB): 1}}, "bad_logit_bias"),
    ({"logit_bias": {"-1": 1}}, "bad_logit_bias"),
    ({"logit_bias": {"1": None}}, "bad_logit_bias"),
    ({"logit_bias": {"1": [1]}}, "bad_logit_bias"),
    ({"logit_bias": {"1": float("nan")}}, "bad_logit_bias"),
    ({"logit_bias": {"\u0663": 1}}, "bad_logit_bias"),
    ({"min_p": float("nan")}, "bad_number"),
    ({"temperature": float("inf")}, "bad_number"),
    ({"top_p": float("nan")}, "bad_number"),
    ({"max_tokens": 2**63}, "bad_integer"), ({"top_k": -2**64}, "bad_integer"),
    ({"seed": -1}, "bad_seed"), ({"seed": 2**64}, "bad_seed"),
    ({"chat_template_kwargs": {"return_tensors": "np"}}, "bad_chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": False}}, "bad_chat_template_kwargs"),
    ({"chat_template_kwargs": {"chat_template": "{{ x }}"}}, "bad_chat_template_kwargs"),
    ({"chat_template_kwargs": "x"}, "bad_chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}]}]},
     "remote_image_refused"),
    ({"stream": True, "stream_options": 5}, "bad_stream_options"),
])
def test_completion_bodies_that_kill_the_generation_thread_are_refused(extra, code):
    with pytest.raises(SeamError) as e:
        checks.check_completion_body(dict(GOOD, **extra), VOCAB)
    assert (e.value.status, e.value.code) == (400, code)


def test_empty_text_prompt_is_refused():
    # Regression (issue 50, killers): {"prompt": ""} killed the generation thread.
    with pytest.raises(SeamError) as e:
        checks.check_completion_body({"prompt": ""}, VOCAB)
    assert e.value.code == "bad_prompt"


@pytest.mark.parametrize("extra", [
    {}, {"stop": "x"}, {"stop": ["x", ""]}, {"stop": None}, {"logit_bias": {"0": -100, "49151": 2.5}},
    {"seed": 0}, {"seed": 2**64 - 1}, {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05},
    {"chat_template_kwargs": {"enable_thinking": False}}, {"max_tokens": 2**63 - 1},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
])
def test_ordinary_bodies_pass(extra):
    checks.check_completion_body(dict(GOOD, **extra), VOCAB)


# ---- body and JSON bounds --------------------------------------------------------------------


def headers_of(**fields):
    message = Message()
    for name, value in fields.items():
        message[name.replace("_", "-")] = value
    return message


def test_body_length_is_judged_before_reading():
    assert bounds.body_length(headers_of(), 100) == 0
    assert bounds.body_length(headers_of(Content_Length="100"), 100) == 100
    assert code_of(lambda: bounds.body_length(headers_of(Content_Length="101"), 100)) == (
        413, "body_too_large")
    assert code_of(lambda: bounds.body_length(headers_of(Transfer_Encoding="chunked"), 100)) == (
        411, "length_required")
    for bad in ("-1", "1e3", "0x10", " ", "1, 2"):
        assert code_of(lambda: bounds.body_length(headers_of(Content_Length=bad), 100)) == (
            400, "bad_length"), bad


def test_deep_json_is_a_400_not_a_recursion_error():
    # Regression (issue 50, finding: RecursionError answered 500 on /hetero/mount).
    for depth in (65, 1000, 100_000):
        raw = b"[" * depth + b"]" * depth
        assert code_of(lambda: bounds.loads_bounded(raw)) == (400, "bad_json"), depth
    raw = b'{"a":' * 64 + b"1" + b"}" * 64
    assert bounds.json_depth(bounds.loads_bounded(raw)) == 64


def test_host_must_be_loopback_unless_remote_is_allowed():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        bounds.check_host(host, allow_remote=False)
    for host in ("0.0.0.0", "", "::", "192.168.1.4", "example.com"):
        with pytest.raises(SystemExit) as e:
            bounds.check_host(host, allow_remote=False)
        assert "--allow-remote" in str(e.value)
        bounds.check_host(host, allow_remote=True)


# ---- tenants ---------------------------------------------------------------------------------


class FakeArgs:
    pass


def test_salt_is_taken_out_of_the_body_and_checked():
    body = {"prompt": "x", "hetero_cache_salt": "0af"}
    assert tenants.take_salt(body) == "0af" and "hetero_cache_salt" not in body
    assert tenants.take_salt({"prompt": "x"}) == ""
    for bad in ("", "0AF", "x", "0" * 65, 5, None, ["0"]):
        assert code_of(lambda: tenants.take_salt({"hetero_cache_salt": bad})) == (
            400, "bad_cache_salt"), bad


def test_inserts_go_to_their_requests_partition_or_nowhere():
    t = tenants.Tenants()
    model = ("m", None, None)
    log = []

    def generation():
        a, b = t.tag("aa"), t.tag("bb")
        for tag, prompt in ((a, [1, 2, 3, 4]), (b, [1, 2, 9, 9])):
            args = FakeArgs()
            args.hetero_tag = tag
            t.tokenized(args)
            log.append(t.lookup_key(model, prompt))
        log.append(t.insert_key(model, [1, 2, 3], "user"))  # only a's prompt has it
        log.append(t.insert_key(model, [1, 2], "system"))  # both: two partitions, dropped
        log.append(t.insert_key(model, [7, 7], "user"))  # nobody's: dropped
        t.finishing(b)
        log.append(t.insert_key(model, [1, 2, 9, 9, 5], "assistant"))  # b's final insert
        log.append(t.in_flight())
        t.clear()  # a new epoch: a's later inserts are dropped
        log.append(t.insert_key(model, [1, 2, 3, 4], "user"))

    thread = threading.Thread(target=generation)
    t.generation_thread = thread
    thread.start()
    thread.join()
    assert log == [(model, "aa"), (model, "bb"), (model, "aa"), None, None, (model, "bb"), 1,
                   None]
    assert t.dropped == 3


def test_no_salt_keeps_the_model_key_and_other_threads_change_nothing():
    t = tenants.Tenants()
    t.generation_thread = threading.Thread(target=lambda: None)
    args = FakeArgs()
    args.hetero_tag = t.tag("")
    t.tokenized(args)  # not the generation thread: a seam dry run
    assert t.lookup_key("m", [1, 2]) == "m" and t.in_flight() == 0
    assert tenants.partition("m", "") == "m" and tenants.partition("m", "ab") == ("m", "ab")


def test_connections_being_served_are_not_capped_per_client():
    # Regression (soak, issue 50): the per-client cap counted connections being served, so the
    # front door's 65th request in flight (all its requests come from 127.0.0.1) was refused,
    # its health checks too, and hetero up restarted a healthy decoder. Only connections still
    # waiting for their request are capped; past the cap the oldest of those makes room.
    import socket

    cb = bounds.ConnectionBounds(request_deadline_s=60, max_per_client=4, max_total=8)
    pairs = [socket.socketpair() for _ in range(12)]
    try:
        served = [a for a, _ in pairs[:10]]
        for s in served:
            assert cb.admit(s, "127.0.0.1")
            assert cb.arrived(s)  # its request is in: being served
        waiting = [a for a, _ in pairs[10:]]
        for s in waiting:
            assert cb.admit(s, "127.0.0.1")
        assert cb.stats()["evicted"] == 0 and cb.stats()["refused"] == 0
        extra = [socket.socketpair() for _ in range(3)]
        pairs += extra
        for a, _ in extra:  # 5 waiting from one address: the oldest waiting one makes room
            assert cb.admit(a, "127.0.0.1")
        assert cb.stats()["evicted"] == 1 and cb.stats()["refused"] == 0
        assert not cb.arrived(waiting[0])  # the one that made room was cut
    finally:
        for a, b in pairs:
            a.close()
            b.close()
