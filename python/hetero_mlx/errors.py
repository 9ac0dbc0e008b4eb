"""The seam's one error type: an HTTP status plus a stable code, never a stack trace."""

from typing import Dict, Optional


class SeamError(Exception):
    """An expected failure of a seam request; handlers turn it into a JSON error body (and
    `headers`, e.g. X-Hetero-Time on a clock-skew refusal)."""

    def __init__(
        self, status: int, code: str, message: str, headers: Optional[Dict[str, str]] = None
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}


def bad_request(code: str, message: str) -> SeamError:
    return SeamError(400, code, message)


def conflict(code: str, message: str) -> SeamError:
    """The request is well formed but disagrees with the loaded decoder."""
    return SeamError(409, code, message)


def insufficient_storage(code: str, message: str) -> SeamError:
    """The request would take more memory than the decoder may give it (HTTP 507)."""
    return SeamError(507, code, message)
