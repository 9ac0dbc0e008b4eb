"""Who may call the seam, how, and where it may write; the same rules for both decoders.

A web page open in a browser on the decoder's machine can reach the decoder's port. So:
  - with `serve --secret-file`, every request on the decoder's port (the seam's /hetero/* and the
    decoder's own paths alike) must be signed: `Authorization: Hetero-HMAC-SHA256 t=, n=, s=`
    (docs/design/auth.md), an HMAC under a key derived from the secret over the method, the
    target and the body, checked in constant time, each nonce accepted once;
  - every /hetero/* POST needs `Content-Type: application/json`: a browser sends any other body
    cross-origin without asking first (a "simple" request), but a JSON one only after a
    preflight, which the seam never approves (no CORS header on any /hetero/* reply);
  - /hetero/cache writes only a plain file name inside the seam's own dump directory,
    `<store>/dumps/` (0700), its files 0600.

Test vector (tests/py/test_access.py; the C++ signer must give the same): secret
"00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff", POST /hetero/tokenize, body
b'{"ids":[1,2,3]}', t=1700000000, n="0123456789abcdef0123456789abcdef" ->
s=086f761d1b634dd0cdead66edfc75caf08f9faf8e54736c85d6d0036b10ba4af
"""

import hashlib
import hmac
import os
import re
import secrets
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from .errors import SeamError, bad_request

DUMPS_DIR = "dumps"
# A dump's name: a plain file name, never a path (no separator, no leading dot, so no "..").
_DUMP_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.safetensors")
# The shortest and longest secret, and the largest secret file, read; `hetero up` writes 64 hex
# digits. A short secret is guessable offline from one signed request.
MIN_SECRET_CHARS = 32
_MAX_SECRET_CHARS = 4096
_MAX_SECRET_FILE_BYTES = 65536

SCHEME = "Hetero-HMAC-SHA256"
_REQUEST_KEY_LABEL = b"hetero/auth/v1 requests"
_SIGNED_PREFIX = b"hetero-request-v1\n"
# The header as the signers write it ("t=..., n=..., s=..."), in that order and case; as the
# C++ verifier (src/common/auth.cc), spaces may precede each field, and nothing follows s.
_AUTHORIZATION = re.compile(
    SCHEME + r" +t=([0-9]{1,12}), *n=([0-9a-f]{32}), *s=([0-9a-f]{64})"
)
MAX_CLOCK_SKEW_S = 300
NONCE_TTL_S = 600.0  # twice the skew: a nonce outlives every time at which its t is accepted
MAX_NONCES = 262_144


def read_secret(path: Path) -> str:
    """The shared secret in `path` (surrounding whitespace dropped); SystemExit when unusable:
    unreadable, readable or writable by anyone but its owner, or shorter than 32 characters."""
    try:
        with open(path, "rb") as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
            raw = f.read(_MAX_SECRET_FILE_BYTES + 1)
    except OSError as e:
        raise SystemExit(f"hetero_mlx: cannot read --secret-file {path}: {e}") from None
    if mode & 0o077:
        raise SystemExit(
            f"hetero_mlx: --secret-file {path} has mode {mode:04o}: group or others may read or "
            f"write it; run chmod 600 {path}"
        )
    secret = raw.decode("latin-1").strip(" \t\r\n")
    # As the C++ side reads it (common/secret.cc): printable ASCII, no space inside.
    if len(raw) > _MAX_SECRET_FILE_BYTES or not 1 <= len(secret) <= _MAX_SECRET_CHARS or not all(
        33 <= ord(c) < 127 for c in secret
    ):
        raise SystemExit(
            f"hetero_mlx: --secret-file {path} must hold one token of {MIN_SECRET_CHARS} to 4096 "
            "printable ASCII characters"
        )
    if len(secret) < MIN_SECRET_CHARS:
        raise SystemExit(
            f"hetero_mlx: the secret in --secret-file {path} has {len(secret)} characters; it "
            f"needs at least {MIN_SECRET_CHARS} (hetero up writes 64 hex digits)"
        )
    return secret


# ---- signed requests (docs/design/auth.md) -------------------------------------------------


def request_key(secret: str) -> bytes:
    """K_req = HMAC-SHA256(S, "hetero/auth/v1 requests"): the only key requests are signed with;
    a signature reveals nothing of it, nor of S or the frame key."""
    return hmac.new(secret.encode("latin-1"), _REQUEST_KEY_LABEL, hashlib.sha256).digest()


def request_signature(key: bytes, method: str, target: str, body: bytes, t: int, n: str) -> str:
    """s = hex HMAC-SHA256(K_req, "hetero-request-v1\\n" METHOD \\n TARGET \\n hex(SHA256(body))
    \\n t \\n n)."""
    message = b"\n".join(
        (
            _SIGNED_PREFIX + method.encode("latin-1"),
            target.encode("latin-1"),
            hashlib.sha256(body).hexdigest().encode(),
            str(t).encode(),
            n.encode(),
        )
    )
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def signed_headers(
    secret: str,
    method: str,
    target: str,
    body: bytes = b"",
    t: Optional[int] = None,
    n: Optional[str] = None,
) -> Dict[str, str]:
    """The Authorization header of one signed request (now and a fresh nonce unless given)."""
    t = int(time.time()) if t is None else t
    n = secrets.token_hex(16) if n is None else n
    s = request_signature(request_key(secret), method, target, body, t, n)
    return {"Authorization": f"{SCHEME} t={t}, n={n}, s={s}"}


@dataclass(frozen=True)
class Credentials:
    """A well-formed, timely Authorization header, not yet checked against the body."""

    t: int
    n: str
    s: str


def unauthorized(code: str, message: str, headers: Optional[Dict[str, str]] = None) -> SeamError:
    return SeamError(401, code, message, {"WWW-Authenticate": SCHEME, **(headers or {})})


class NonceMemory:
    """The nonces of the last `ttl_s` seconds' accepted requests, at most `capacity` of them.

    Only requests whose signature checks are remembered, so nobody without the key can fill it;
    full of unexpired nonces, a request is refused (503 busy) rather than one forgotten early,
    which would let its request be replayed."""

    def __init__(self, ttl_s: float = NONCE_TTL_S, capacity: int = MAX_NONCES,
                 clock: Callable[[], float] = time.monotonic):
        self._ttl_s, self._capacity, self._clock = ttl_s, capacity, clock
        self._seen: "OrderedDict[str, float]" = OrderedDict()  # nonce -> expiry, oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)

    def remember(self, nonce: str) -> None:
        with self._lock:
            now = self._clock()
            while self._seen and next(iter(self._seen.values())) <= now:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise unauthorized("replayed", "this request's nonce was already used")
            if len(self._seen) >= self._capacity:
                raise SeamError(503, "busy", "too many signed requests in the last 10 minutes")
            self._seen[nonce] = now + self._ttl_s


class RequestAuth:
    """The receiver's checks, in the order auth.md gives: check_header before the body is read
    (form, clock skew), check_body after (signature, then the nonce)."""

    def __init__(self, secret: str, clock: Callable[[], float] = time.time,
                 nonces: Optional[NonceMemory] = None):
        self._key = request_key(secret)
        self._clock = clock
        self.nonces = nonces if nonces is not None else NonceMemory()

    def check_header(self, header: Optional[str]) -> Credentials:
        match = _AUTHORIZATION.fullmatch(header or "")
        if match is None:
            raise unauthorized(
                "unauthorized",
                f"every request needs Authorization: {SCHEME} t=<unix seconds>, n=<32 hex>, "
                "s=<64 hex> (docs/design/auth.md)",
            )
        now = int(self._clock())
        t = int(match.group(1))
        if abs(now - t) > MAX_CLOCK_SKEW_S:
            raise unauthorized(
                "clock_skew",
                f"the request's time {t} is {t - now:+d} s from this server's {now} (at most "
                f"{MAX_CLOCK_SKEW_S} s)",
                {"X-Hetero-Time": str(now)},
            )
        return Credentials(t, match.group(2), match.group(3))

    def check_body(self, creds: Credentials, method: str, target: str, body: bytes) -> None:
        want = request_signature(self._key, method, target, body, creds.t, creds.n)
        if not hmac.compare_digest(want.encode(), creds.s.encode()):
            raise unauthorized(
                "bad_signature", "the signature does not match this method, target and body"
            )
        self.nonces.remember(creds.n)


def check_json_body(content_type: Optional[str]) -> None:
    """415 unless the request says its body is JSON (parameters such as charset allowed)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise SeamError(
            415, "unsupported_media_type",
            f"seam requests need Content-Type: application/json, not {content_type or 'none'!r}",
        )


def dumps_dir(store: Optional[Path]) -> Optional[Path]:
    """`<store>/dumps`, created; None without a store (then dumps are refused)."""
    if store is None:
        return None
    path = Path(store).resolve() / DUMPS_DIR
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)  # the seam's own: dumps hold prompts' cached rows
    return path


def dump_target(body: dict, dumps: Optional[Path]) -> Path:
    """Where the request's "out" (a plain file name ending in .safetensors) is written."""
    if dumps is None:
        raise SeamError(409, "no_dump_dir", "dumps need a store: start serve with --store")
    out = body.get("out")
    if not isinstance(out, str) or not _DUMP_NAME.fullmatch(out):
        raise bad_request(
            "bad_out",
            "out must be a plain file name ending in .safetensors (letters, digits, '_', '-', "
            f"'.'; no path); it is written in {dumps}",
        )
    return dumps / out


def write_dump(path: Path, save: Callable[[str], Any]) -> None:
    """Calls save(tmp) on a new file beside `path`, then renames it into place: a reader never
    sees half a dump, and a link already at `path` is replaced, not followed. Mode 0600."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        save(tmp)
        os.chmod(tmp, 0o600)  # whatever the writer did to the file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
