"""Who may call the seam, how, and where it may write; the same rules for both decoders.

A web page open in a browser on the decoder's machine can reach the decoder's port. So:
  - with `serve --secret-file`, every /hetero/* request needs `Authorization: Bearer <secret>`
    (the file's content; `hetero up` writes one per stack), compared in constant time;
  - every /hetero/* POST needs `Content-Type: application/json`: a browser sends any other body
    cross-origin without asking first (a "simple" request), but a JSON one only after a
    preflight, which the seam never approves (no CORS header on any /hetero/* reply);
  - /hetero/cache writes only a plain file name inside the seam's own dump directory,
    `<store>/dumps/`.
"""

import hmac
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from .errors import SeamError, bad_request

DUMPS_DIR = "dumps"
# A dump's name: a plain file name, never a path (no separator, no leading dot, so no "..").
_DUMP_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.safetensors")
# The longest secret, and secret file, read; `hetero up` writes 64 hex digits.
_MAX_SECRET_CHARS = 4096
_MAX_SECRET_FILE_BYTES = 65536


def read_secret(path: Path) -> str:
    """The shared secret in `path` (surrounding whitespace dropped); SystemExit when unusable."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_SECRET_FILE_BYTES + 1)
    except OSError as e:
        raise SystemExit(f"hetero_mlx: cannot read --secret-file {path}: {e}") from None
    secret = raw.decode("latin-1").strip(" \t\r\n")
    # As the C++ side reads it (common/secret.cc): printable ASCII, no space inside.
    if len(raw) > _MAX_SECRET_FILE_BYTES or not 1 <= len(secret) <= _MAX_SECRET_CHARS or not all(
        33 <= ord(c) < 127 for c in secret
    ):
        raise SystemExit(
            f"hetero_mlx: --secret-file {path} must hold one token of 1 to 4096 printable ASCII "
            "characters"
        )
    return secret


def check_auth(header: Optional[str], secret: Optional[str]) -> None:
    """401 unless `header` is `Bearer <secret>`; no check without a secret."""
    if secret is None:
        return
    want = ("Bearer " + secret).encode()
    if not hmac.compare_digest((header or "").encode("latin-1", "replace"), want):
        raise SeamError(401, "unauthorized", "the seam needs Authorization: Bearer <secret>")


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
    path.mkdir(parents=True, exist_ok=True)
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
    sees half a dump, and a link already at `path` is replaced, not followed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        save(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
