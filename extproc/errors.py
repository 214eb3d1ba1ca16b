"""Every exception the package raises on purpose, in one place.

    ExtprocError
    ├── ConfigError          bad configuration; lists every problem, each naming its key
    ├── RequestError         the client's request is unusable; maps to a 4xx JSON answer
    │   ├── BadRequest       400: malformed JSON, wrong types, invalid values
    │   ├── BodyTooLarge     413: body over the configured cap
    │   └── UnsupportedMedia 415: a content encoding we refuse
    └── LedgerUnavailable    the ledger's store did not answer in time (wraps redis errors)

Third-party exceptions are translated once, where they enter (``raise ... from exc``), so
callers above the adapters only ever handle this tree.
"""

from __future__ import annotations


class ExtprocError(Exception):
    """Base of every error this package raises deliberately."""


class ConfigError(ExtprocError):
    """Configuration that cannot be used. ``problems`` holds one line per bad key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))


class RequestError(ExtprocError):
    """A request we answer ourselves with an OpenAI-style JSON error body.

    ``message`` must never contain prompt text: it is sent to the client and may be logged.
    """

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        self.message = message
        self.param = param
        self.code = code
        super().__init__(message)


class BadRequest(RequestError):
    status = 400


class BodyTooLarge(RequestError):
    status = 413


class UnsupportedMedia(RequestError):
    status = 415


class LedgerUnavailable(ExtprocError):
    """The ledger's backing store failed or timed out; the caller applies the fault policy."""
