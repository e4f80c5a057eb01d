"""Client-chosen ids that make retries idempotent.

* lease ids (``CreateSandboxRequest.lease_id``): ``[a-z0-9-]``, at most 40, starting with a
  letter or digit; a retry with the same lease id returns the sandbox the first attempt made.
  Ours match the server's own shape (12 hex digits of a millisecond clock + 12 random), so
  sandbox ids still sort roughly by creation.
* request ids (``ExecRequest.request_id``): ``[A-Za-z0-9._-]``, at most 128; a repeat finds
  the same command instead of running it again.
"""

from __future__ import annotations

import re
import secrets
import time

LEASE_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def new_lease_id() -> str:
    """A fresh lease id: 24 lowercase hex digits, time-ordered."""
    ms = int(time.time() * 1000) & 0xFFFF_FFFF_FFFF
    return f"{ms:012x}{secrets.randbits(48):012x}"


def new_request_id() -> str:
    """A fresh exec request id (``py-`` + 32 hex digits)."""
    return "py-" + secrets.token_hex(16)


def check_lease_id(lease_id: str) -> str:
    """Returns ``lease_id`` or raises ``ValueError`` when the server would reject it."""
    if not LEASE_ID_RE.match(lease_id):
        raise ValueError(f"lease id {lease_id!r} must be 1-40 characters of [a-z0-9-], starting with [a-z0-9]")
    return lease_id


def check_request_id(request_id: str) -> str:
    """Returns ``request_id`` or raises ``ValueError`` when the server would reject it."""
    if not REQUEST_ID_RE.match(request_id):
        raise ValueError(f"request id {request_id!r} must be 1-128 characters of [A-Za-z0-9._-]")
    return request_id
